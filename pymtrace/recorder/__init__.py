"""`pymtrace record`'s live recorder, recorder.record(options): options (what a recording is
asked), plan (what is probed where), drain (the drain loop), stacks (--stacks' unwinder),
outputs (the files and the closing summary)."""
