"""The bundled demo workload (demo.c): built with gcc on first use, cached, started on demand.

    from pymtrace.tracee.demo import start_demo
    proc = start_demo()          # subprocess.Popen of the running demo (comm "pymtrace-demo")
    ...
    stop_demo(proc)

The binary is cached under /var/cache/pymtrace (root) or $XDG_CACHE_HOME/pymtrace
(~/.cache/pymtrace), or $PYMTRACE_CACHE_DIR, in a directory named after a hash of the
source and compiler flags, so an updated demo.c is rebuilt and concurrent users never see
a half-written binary. The demo dies with its parent (PR_SET_PDEATHSIG), so a killed
`pymtrace top --demo` does not leave it running.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from typing import IO, Any, Union

from pymtrace.errors import PymtraceError

SOURCE = pathlib.Path(__file__).resolve().with_name("demo.c")
NAME = "pymtrace-demo"  # also its comm (<= 15 characters)
CFLAGS = ["-O1", "-g", "-fno-builtin", "-fno-omit-frame-pointer", "-pthread"]
_PR_SET_PDEATHSIG = 1


def cache_dir() -> pathlib.Path:
    env = os.environ.get("PYMTRACE_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    if os.geteuid() == 0:
        return pathlib.Path("/var/cache/pymtrace")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pymtrace"


def build_demo(compiler: str | None = None) -> str:
    """Path of the compiled demo, compiling it first if needed."""
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        raise PymtraceError(f"the demo source {SOURCE} is missing ({exc.strerror}); reinstall pymtrace") from None
    cc = compiler or os.environ.get("CC") or "gcc"
    digest = hashlib.sha256(source + " ".join([cc] + CFLAGS).encode()).hexdigest()[:16]
    out_dir = cache_dir() / f"demo-{digest}"
    binary = out_dir / NAME
    if binary.is_file() and os.access(binary, os.X_OK):
        return str(binary)
    if shutil.which(cc) is None:
        raise PymtraceError(
            f"the demo workload needs a C compiler: `{cc}` not found; install gcc "
            "(apt-get install gcc / dnf install gcc)"
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PymtraceError(
            f"cannot create the demo cache directory {out_dir}: {exc.strerror} "
            "(set PYMTRACE_CACHE_DIR to a writable directory)"
        ) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{NAME}.", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines() or ["?"]
            raise PymtraceError(f"compiling the demo workload with {cc} failed: {lines[0].strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, binary)  # atomic: a concurrent start sees the old state or the whole binary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(binary)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_demo(
    seconds: Union[float, str, None] = None,
    stdout: Union[int, IO[Any], None] = subprocess.DEVNULL,
    stderr: Union[int, IO[Any], None] = None,
) -> subprocess.Popen:
    """Start the demo (built if needed) and return its subprocess.Popen.

    seconds: run that long and exit by itself; default: until stopped.
    """
    binary = build_demo()
    argv = [binary] + ([str(int(seconds))] if seconds else [])
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, preexec_fn=_die_with_parent
        )
    except OSError as exc:
        raise PymtraceError(f"cannot start the demo workload {binary}: {exc.strerror}") from None
    _wait_for_libc(proc)
    return proc


def _wait_for_libc(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Return once the demo has mapped its libc, so uprobes can be attached to it at once
    (right after exec the dynamic loader has not mapped it yet)."""
    from pymtrace.tracee import libc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PymtraceError(f"the demo workload exited at once (status {proc.returncode})")
        try:
            if libc.process_libc(proc.pid):
                return
        except PymtraceError:
            pass
        time.sleep(0.005)
    stop_demo(proc)
    raise PymtraceError(f"the demo workload did not map its libc within {timeout:g}s")


def stop_demo(proc: subprocess.Popen | None, timeout: float = 5) -> None:
    """End the demo started by start_demo (SIGTERM, then SIGKILL); safe to call twice."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":  # python -m pymtrace.tracee.demo [SECONDS]: run it in the foreground
    import sys

    p = start_demo(sys.argv[1] if len(sys.argv) > 1 else None, stdout=None)
    try:
        raise SystemExit(p.wait())
    except KeyboardInterrupt:
        stop_demo(p)
