"""Trace file formats, one module each: mtrace_bin (glibc's dj/malloc binary trace), mtrace_text
(glibc's mtrace() log), parquet (columnar recordings), wl (the replay workload); thrift_compact
re-encodes Parquet footers. autodetect reads a trace whatever its format."""
