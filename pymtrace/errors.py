"""Errors that end a command with one clear line on stderr and a non-zero exit."""


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
