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
import time
from typing import IO, Any, Callable, Mapping, Sequence, Union

from pymtrace.errors import PymtraceError
from pymtrace.target import elf, libc

_Stream = Union[int, IO[Any], None]  # what subprocess.Popen takes as stdin/stdout/stderr

_PTRACE_TRACEME = 0
_PTRACE_CONT = 7
_PTRACE_DETACH = 17
_PTRACE_SETOPTIONS = 0x4200
_PTRACE_O_TRACEEXEC = 0x10
_PTRACE_O_TRACEEXIT = 0x40
_PTRACE_EVENT_EXEC = 4
_PTRACE_EVENT_EXIT = 6
_WALL = 0x40000000
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
        self.held = False  # resume(hold_exit=True): still ptraced, stopped again at its exit

    def libc_path(self) -> str | None:
        """The libc the command will map (it is not mapped yet: the loader has not run)."""
        return predict_libc(self.argv, self.exe)

    def resume(self, hold_exit: bool = False) -> None:
        """Let the command run. HOLD_EXIT: stay its ptrace tracer, only so that the kernel
        stops it once more when it exits, before its memory mappings are torn down (heap
        reads its maps then: the libraries a short-lived command loaded are not lost); the
        caller must then call service() regularly from this same thread (the tracer)."""
        if self.resumed:
            return
        self.resumed = True
        if hold_exit:
            options = _PTRACE_O_TRACEEXIT | _PTRACE_O_TRACEEXEC  # an exec is an event, not a SIGTRAP
            if _libc.ptrace(_PTRACE_SETOPTIONS, self.pid, None, ctypes.c_void_p(options)) == 0:
                self.held = True
                _libc.ptrace(_PTRACE_CONT, self.pid, None, None)
                return
        _libc.ptrace(_PTRACE_DETACH, self.pid, None, None)

    def service(self, at_exit: Callable[[int], None] | None = None) -> int | None:
        """For a held command (resume(hold_exit=True)): handle its ptrace stops without
        blocking: at its exit stop call AT_EXIT(pid), then let it go; any other stop (a signal
        for it) is passed on unchanged. Returns its exit status once it has ended, else None."""
        if not self.held:
            return self.proc.poll()
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG | _WALL)
            except ChildProcessError:  # reaped elsewhere
                self.held = False
                return self.proc.returncode
            if pid == 0:
                return None
            if not os.WIFSTOPPED(status):
                self.held = False
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                return self.proc.returncode
            signum, event = os.WSTOPSIG(status), status >> 16
            if signum == signal.SIGTRAP and event == _PTRACE_EVENT_EXIT:
                try:
                    if at_exit is not None:
                        at_exit(self.pid)
                finally:
                    _libc.ptrace(_PTRACE_DETACH, self.pid, None, None)
            elif signum == signal.SIGTRAP and event == _PTRACE_EVENT_EXEC:
                _libc.ptrace(_PTRACE_CONT, self.pid, None, None)
            else:  # a signal on its way to the command: deliver it (a group-stop, reported once
                # the stop signal was delivered, is resumed: the kernel ignores the signal given
                # then, so a held command does not stay stopped: docs/heap.md)
                _libc.ptrace(_PTRACE_CONT, self.pid, None, ctypes.c_void_p(signum))

    def wait(self, timeout: float | None = None) -> int:
        self.resume()
        if self.held:  # keep servicing its stops until it ends
            deadline = None if timeout is None else time.monotonic() + timeout
            while (code := self.service()) is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.argv, timeout)
                time.sleep(0.005)
            return code
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
                return self.wait(wait)
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        if self.held:
            if self.service() is None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.wait()
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.resume()
            self.wait()


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
