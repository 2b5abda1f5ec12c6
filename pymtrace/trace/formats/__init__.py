"""Trace file formats: mtrace_bin (glibc's dj/malloc binary trace), mtrace_text (glibc's
mtrace() log), wl (the simulator's workload). `load_records` reads either trace format."""

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
    return "mtrace-text" if head.startswith(b"= Start") else "mtrace-bin"


def load_records(path: str) -> tuple[str, Iterator[mtrace_bin.Record]]:
    """(format, iterator of mtrace_bin.Record) for a trace in either format."""
    fmt = detect_format(path)
    if fmt == "mtrace-text":
        return fmt, mtrace_text.to_records(mtrace_text.read_file(path))
    return fmt, mtrace_bin.read_file(path)
