"""pymtrace: memory-allocation observability for Linux with eBPF (BCC)."""

__version__ = "0.1.0"
