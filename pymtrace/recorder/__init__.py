"""`pymtrace record`'s live recorder: attach, drain the BPF ring buffer, write the outputs."""
