"""What one recording is asked to do: the typed options `pymtrace record` builds from its arguments."""

from __future__ import annotations

from dataclasses import dataclass

from pymtrace.errors import PymtraceError
from pymtrace.net import protocol

FORMATS = ("mtrace-bin", "mtrace-text", "parquet")
VIAS = ("auto", "interposer", "uprobes")  # how a launched command is recorded (recorder.inprocess.choose)


@dataclass(frozen=True)
class NetworkTarget:
    """record --to: the collector's ADDRESS, how to connect (CONFIG), the sender's memory
    spool in bytes (SPOOL_MEMORY) and how long its end waits for the backlog (SEND_TIMEOUT, s)."""

    address: tuple[str, int]
    config: protocol.ClientConfig
    spool_memory: int
    send_timeout: float


@dataclass(frozen=True)
class RecordOptions:
    """One recording: of the running process PID or of the launched command CMD (exactly one),
    into FORMAT files (OUTPUT for the first process, FORCE: replace it) or to NETWORK, through
    a ring buffer of PAGES pages (a power of two)."""

    pages: int
    pid: int | None = None
    cmd: tuple[str, ...] = ()
    output: str | None = None
    force: bool = False
    format: str = "mtrace-bin"
    network: NetworkTarget | None = None
    poll_interval_ms: float | None = None  # None: DrainPacer decides
    duration_s: float | None = None  # None: until the process exits or a stop signal
    allow_drops: bool = False  # lost events do not make the exit status 3
    follow_forks: bool = False  # children too, each into OUTPUT.PID
    stacks: bool = False  # each allocation's call stack, in a stack table beside each file
    native: bool = False  # --stacks without Python frames (CPython processes' stacks stay native)
    libc: str | None = None  # the libc to probe instead of the one the process maps
    json: bool = False  # the closing summary as JSON on stderr
    quiet: bool = False  # no progress messages
    via: str = "auto"  # one of VIAS

    def __post_init__(self) -> None:
        if self.pid is None and not self.cmd:
            raise PymtraceError("give -p PID or -- CMD ARGS...")
        if self.pid is not None and self.cmd:
            raise PymtraceError("give either -p PID or -- CMD, not both")
        if self.stacks and self.format == "mtrace-text":
            raise PymtraceError(
                "--stacks needs --format mtrace-bin or parquet (a text log has no field for a stack id)"
            )
        if self.native and not self.stacks:
            raise PymtraceError("--native chooses how --stacks shows Python processes: give --stacks too")
        if self.via not in VIAS:
            raise PymtraceError(f"unknown --via {self.via!r}: one of {', '.join(VIAS)}")
        if self.format not in FORMATS:
            raise PymtraceError(f"unknown format {self.format!r}: one of {', '.join(FORMATS)}")

    @property
    def progress(self) -> bool:
        """Whether to print progress messages (neither --quiet nor --json)."""
        return not self.quiet and not self.json
