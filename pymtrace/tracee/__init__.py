"""The traced process: its ELF files, libc and allocator, launch, /proc, process events, unwinding."""
