"""Creating output files safely, for every command that writes one.

Never through a symlink, never at a guessable name, always mode 0600:
* open_exclusive/open_unique: a file written in place while the command runs (record);
* atomic_output: a file that appears complete or not at all (convert, workload, replay --plot),
  written to a mkstemp file in the target's directory, then linked (or, with force,
  renamed) into place.
An existing output is refused unless force; force replaces a symlink itself, never its target.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Any, Iterator

from pymtrace.errors import PymtraceError


def side_file(trace_path: str, suffix: str) -> str:
    """Where the side file SUFFIX (".stacks", ".maps") of the trace TRACE_PATH lives: beside
    it, named as the trace with SUFFIX appended (`app.trace` -> `app.trace.stacks`)."""
    return trace_path + suffix


def _exists_error(path: str) -> PymtraceError:
    return PymtraceError(f"{path} exists; choose another file or use --force")


def check_new(path: str, force: bool = False) -> None:
    """Refuse PATH up front if it exists (before a long run), unless FORCE."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        raise PymtraceError(f"{path} is a directory")
    if not force:
        raise _exists_error(path)


def open_exclusive(path: str, force: bool = False) -> int:
    """Create PATH for writing: O_EXCL|O_NOFOLLOW, mode 0600; never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    check_new(path, force)
    try:
        if os.path.lexists(path):
            os.unlink(path)  # --force: removes a symlink itself, never its target
        return os.open(path, flags, 0o600)
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError as exc:
        raise PymtraceError(f"cannot create {path}: {exc.strerror}") from None


def default_name(base: str) -> str:
    """BASE, or BASE.N for the first N that does not exist (like upstream mtrace-ctl)."""
    if not os.path.lexists(base):
        return base
    n = 1
    while os.path.lexists(f"{base}.{n}"):
        n += 1
    return f"{base}.{n}"


def open_unique(base: str) -> tuple[str, int]:
    """(path, fd) of a new file named like default_name(BASE)."""
    while True:
        path = default_name(base)
        try:
            return path, open_exclusive(path)
        except PymtraceError:
            if os.path.lexists(path):
                continue  # lost a race: try the next name
            raise


def _publish(tmp: str, path: str, force: bool) -> None:
    """Move the finished temporary TMP to PATH atomically."""
    if force:
        os.replace(tmp, path)  # replaces a symlink itself
        return
    try:
        os.link(tmp, path)  # fails if anything, a symlink included, appeared at PATH meanwhile
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError:  # a file system without hard links
        if os.path.lexists(path):
            raise _exists_error(path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_output(path: str, force: bool = False, mode: str = "wb", **kw: Any) -> Iterator[IO[Any]]:
    """`with atomic_output(PATH) as f:` writes F, then puts it at PATH (mode 0600) only if the
    block succeeds; on any error nothing is left behind. KW goes to os.fdopen."""
    check_new(path, force)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise PymtraceError(f"cannot create {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
        try:
            _publish(tmp, path, force)
        except OSError as exc:
            raise PymtraceError(f"cannot create {path}: {exc.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
