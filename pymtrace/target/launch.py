"""Launch a command stopped at its first instruction, so probes attach before it runs.

The child asks to be ptraced and execs; the kernel stops it right after execve, before
the dynamic loader or any user code has run. The caller attaches its probes (uprobes on
the libc file are inode-based, so they take effect when the loader maps libc later) and
then calls resume(), which detaches ptrace and lets the command run untraced by ptrace.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
from typing import IO, Any, Mapping, Sequence, Union

from pymtrace.errors import PymtraceError
from pymtrace.target import elf, libc

_Stream = Union[int, IO[Any], None]  # what subprocess.Popen takes as stdin/stdout/stderr

_PTRACE_TRACEME = 0
_PTRACE_DETACH = 17
_libc = ctypes.CDLL(None, use_errno=True)


def _traceme() -> None:
    # the command gets the SIGINT disposition pymtrace inherited (ignored in a background job
    # of a script), not the handler pymtrace installed for itself (pymtrace.cli)
    from pymtrace import stopping

    if stopping.INHERITED_SIGINT == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _libc.ptrace(_PTRACE_TRACEME, 0, None, None) != 0:
        os._exit(126)


class Launched:
    """A command stopped at exec. Use resume() once probes are attached, then wait()."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdin: _Stream = None,
        stdout: _Stream = None,
        stderr: _Stream = None,
    ) -> None:
        if not argv:
            raise PymtraceError("no command given after --")
        exe = shutil.which(argv[0]) if "/" not in argv[0] else argv[0]
        if exe is None or not os.path.exists(exe):
            raise PymtraceError(f"command not found: {argv[0]}")
        self.argv = list(argv)
        self.exe = exe
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            preexec_fn=_traceme,
        )
        self.pid = self.proc.pid
        _, status = os.waitpid(self.pid, 0)
        if not os.WIFSTOPPED(status):
            code = os.waitstatus_to_exitcode(status)
            self.proc.returncode = code
            raise PymtraceError(f"{argv[0]} exited before it could be traced (status {code})")
        self.resumed = False

    def libc_path(self) -> str | None:
        """The libc the command will map (it is not mapped yet: the loader has not run)."""
        return predict_libc(self.argv, self.exe)

    def resume(self) -> None:
        if not self.resumed:
            _libc.ptrace(_PTRACE_DETACH, self.pid, None, None)
            self.resumed = True

    def wait(self, timeout: float | None = None) -> int:
        self.resume()
        return self.proc.wait(timeout)

    def stop(self, grace: float = 5.0) -> int:
        """After pymtrace was told to stop: give the command GRACE seconds to end by itself
        (Ctrl-C reached it too), then SIGTERM, then SIGKILL. Returns its exit status."""
        self.resume()
        for sig, wait in ((None, grace), (signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            if sig is not None and self.proc.poll() is None:
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                return self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.resume()
            self.proc.wait()


def predict_libc(argv: Sequence[str], exe: str | None = None) -> str | None:
    """Which libc ARGV will load, asked from its own dynamic loader (`ld.so --list`).

    Handles a program started through a loader (`ld-linux-x86-64.so.2 --library-path DIR PROG`)
    as well as a plain dynamically linked program. Returns None for a static program.
    """
    exe = exe or shutil.which(argv[0]) or argv[0]
    if re.search(r"/ld-linux[^/]*\.so", os.path.realpath(exe)) or re.search(r"ld-linux", os.path.basename(exe)):
        # loader invocation: keep its options, insert --list before the program
        opts, rest = [], list(argv[1:])
        while rest and rest[0].startswith("--"):
            opt = rest.pop(0)
            opts.append(opt)
            if opt in ("--library-path", "--preload", "--audit", "--argv0") and rest:
                opts.append(rest.pop(0))
        if not rest:
            return None
        cmd = [exe] + opts + ["--list", shutil.which(rest[0]) or rest[0]]
    else:
        interp = elf.interpreter(exe)
        if interp is None:
            return None
        cmd = [interp, "--list", exe]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        m = re.search(r"=>\s*(\S+)\s*\(0x", line)
        if m and libc.is_libc_path(m.group(1)):
            return os.path.realpath(m.group(1))
    return None
