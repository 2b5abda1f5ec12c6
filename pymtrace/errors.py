"""Errors that end a command with one clear line on stderr and a non-zero exit, and
printable(): how such a line (or any line) shows a name a process chose."""


class PymtraceError(Exception):
    """A user-facing failure: the message is printed as `pymtrace: error: MESSAGE`."""

    exit_code = 1


class NotRootError(PymtraceError):
    def __init__(self, what: str = "this command") -> None:
        super().__init__(f"{what} needs root (BPF and uprobes); run it with sudo")


class ProcessGone(PymtraceError):
    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} does not exist (or exited)")
        self.pid = pid


class MissingLibrary(PymtraceError):
    """A system library pymtrace needs is not installed (the message names the package)."""


class CorruptFile(PymtraceError):
    """A trace or workload file that cannot be decoded."""

    exit_code = 2


class BadQuery(PymtraceError):
    """A user's SQL query that DuckDB rejected (analyze --sql)."""

    exit_code = 2


class RecordingStopped(PymtraceError):
    """A recording cannot go on exact (a write failed, a program a launched command exec'd
    cannot be probed): it stops, its files keep every complete record made before."""


class WriteFailed(RecordingStopped):
    """Writing a trace failed (disk full, quota, I/O error): recording stops, the file keeps
    every complete record written before the failure."""


def printable(text: object, keep: str = "") -> str:
    """TEXT with every character a terminal would act on written out as an escape: control
    characters as \\xNN (ESC -> \\x1b, as `ps` and `htop` refuse to pass them), other
    unprintable ones (bidi overrides, unassigned code points) as \\uNNNN. KEEP: characters to
    pass as they are (the newlines of a multi-line report). Every name a process chooses
    (comm, paths, symbols, cgroup names) goes through it before it reaches a terminal."""
    text = str(text)
    if text.isprintable() and not keep:
        return text  # the common case: nothing to scan twice
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
