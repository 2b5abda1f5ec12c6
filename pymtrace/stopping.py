"""How every command stops: the first SIGINT/SIGTERM raises KeyboardInterrupt (the command's
clean-up runs as on Ctrl-C), later ones are ignored, and a block can defer a stop to its end.
One module below the commands, so the library code that must honour a stop (record's drain,
probes' loop, launch's signal dispositions) does not import the CLI."""

from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Iterator

# SIGINT's disposition when pymtrace started (signal.SIG_IGN in a background job of a script)
INHERITED_SIGINT = None
_stopping = False


def _stop(signum: int, frame: FrameType | None) -> None:
    """The first SIGINT/SIGTERM raises KeyboardInterrupt: the command stops as on Ctrl-C.
    Later ones are ignored: the command is already stopping (a bounded drain, flushing
    files, detaching probes), and interrupting that would leave its work half done (and
    BCC's exit handlers printing tracebacks). SIGKILL still ends it at once; the kernel
    then removes the probes."""
    global _stopping, _deferred
    if _stopping:
        return
    if _deferring:
        _deferred = True
        return
    _stopping = True
    raise KeyboardInterrupt


_deferring = False
_deferred = False


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """A stop signal arriving inside the block takes effect at its end. Blocking the signals
    (pthread_sigmask) is not enough: Python runs a handler at a bytecode boundary after the
    C-level signal, so one that arrived just before the block would still raise in it (a
    batch of records written but not counted)."""
    global _deferring, _deferred
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
    if _deferred:  # the block ended normally: stop now, as the signal asked
        _deferred = False
        _stop(signal.SIGINT, None)


def stopping() -> bool:
    """Whether a stop signal (SIGINT/SIGTERM) has arrived (or begin_stopping was called)."""
    return _stopping


def begin_stopping() -> None:
    """A command stops by itself (--duration, its target exited): SIGINT/SIGTERM arriving
    from now on are ignored like a second one, so they cannot cut its clean-up short."""
    global _stopping
    _stopping = True


def install() -> None:
    """Make SIGINT and SIGTERM stop the command (cli.main calls this first). Remembers the
    SIGINT disposition pymtrace inherited, for the commands it launches."""
    global INHERITED_SIGINT, _stopping
    _stopping = False
    previous = signal.signal(signal.SIGINT, _stop)
    if INHERITED_SIGINT is None:
        INHERITED_SIGINT = previous
    signal.signal(signal.SIGTERM, _stop)
