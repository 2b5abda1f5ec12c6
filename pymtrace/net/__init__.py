"""`record --to` and `pymtrace collect`: the wire protocol, the recorder's sender, the collector server."""
