"""Reading a trace whatever its format: the format of a file (detect_format), the allocator it
was recorded from (recorded_allocator) and its records (load_records)."""

from __future__ import annotations

from typing import Iterator

from pymtrace.errors import PymtraceError
from pymtrace.trace.formats import mtrace_bin, mtrace_text


def detect_format(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise PymtraceError(f"cannot read {path}: {exc.strerror}") from None
    if head.startswith(b"= Start"):
        return "mtrace-text"
    return "parquet" if head.startswith(b"PAR1") else "mtrace-bin"


def recorded_allocator(path: str) -> str | None:
    """The allocator family a trace says it was recorded from ("jemalloc", "tcmalloc",
    "mimalloc", "generic": another object's own malloc), or None (glibc, not said: an older
    or converted trace, a text log, a .wl workload). mtrace-bin: the MAGIC record's size3;
    Parquet: the `pymtrace.allocator` metadata."""
    fmt = detect_format(path)
    if fmt == "parquet":
        from pymtrace.trace.formats import parquet

        meta = parquet.open_file(path).schema_arrow.metadata or {}
        name = meta.get(b"pymtrace.allocator", b"").decode(errors="replace")
        return name if name and name != "glibc" else None
    if fmt != "mtrace-bin":
        return None
    first = mtrace_bin.read_first(path)
    try:
        return mtrace_bin.allocator_of(first, mtrace_bin.detect_byteorder(first))
    except PymtraceError:  # not a trace (a .wl workload): says nothing
        return None


def load_records(path: str) -> tuple[str, Iterator[mtrace_bin.Record]]:
    """(format, iterator of mtrace_bin.Record) for a trace in any of the formats."""
    fmt = detect_format(path)
    if fmt == "parquet":
        from pymtrace.trace.formats import parquet  # pyarrow: ~0.1 s to import, only when needed

        parquet.open_file(path)  # a corrupt file fails here, before any output
        return fmt, parquet.iter_records(path)
    if fmt == "mtrace-text":
        return fmt, mtrace_text.to_records(mtrace_text.read_file(path))
    return fmt, mtrace_bin.read_file(path)
