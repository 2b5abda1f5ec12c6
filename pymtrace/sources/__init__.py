"""Live BPF sources: programs attached to processes and the kernel, read into snapshots."""
