"""Launch a command stopped before its code runs, so probes attach before it allocates.

The child asks to be ptraced and execs; the kernel stops it right after execve, before
the dynamic loader or any user code has run. run_until_loaded() then lets the loader map
every object the program needs (DT_NEEDED, LD_PRELOAD) and stops it before any of their
initializers run (the loader's debugger rendezvous, see there), so the caller can see where
its malloc resolves (tracee.libc.allocator, as for a running process) and attach there.
resume() detaches ptrace, or (hold_exit, on_exec) stays the tracer: then service() handles
its stops, and each exec is stopped at the same point again.
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
from pymtrace.tracee import elf, libc, proc

_Stream = Union[int, IO[Any], None]  # what subprocess.Popen takes as stdin/stdout/stderr

_PTRACE_TRACEME = 0
_PTRACE_PEEKDATA = 2
_PTRACE_POKEDATA = 5
_PTRACE_CONT = 7
_PTRACE_SINGLESTEP = 9
_PTRACE_GETREGS = 12
_PTRACE_SETREGS = 13
_PTRACE_DETACH = 17
_PTRACE_SETOPTIONS = 0x4200
_PTRACE_O_TRACEEXEC = 0x10
_PTRACE_O_TRACEEXIT = 0x40
_PTRACE_EVENT_EXEC = 4
_PTRACE_EVENT_EXIT = 6
_WALL = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long  # PEEKDATA returns a whole word
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_AT_BASE, _AT_ENTRY = 7, 9  # auxv: the interpreter's load address, the program's entry point
_RIP = 16  # index of rip in struct user_regs_struct (x86-64)
_RT_CONSISTENT = 0  # struct r_debug's r_state once the loader's list of objects is complete
_RENDEZVOUS_HITS = 64  # _dl_debug_state calls waited for at most (RT_ADD, then RT_CONSISTENT)


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
        self.hold_exit = False
        self.on_exec: Callable[[int], None] | None = None  # resume(on_exec=...): each exec stopped

    def run_until_loaded(self) -> str:
        """Let the command (stopped at exec) run until its dynamic loader has mapped every
        object its program needs (LD_PRELOAD, DT_NEEDED, their dependencies), and stop it
        there, before any initializer of theirs or of the program has run: its malloc calls
        can then be resolved like a running process's (tracee.libc.allocator). The stop is
        the loader's debugger rendezvous (<link.h>'s r_debug protocol, where gdb stops too):
        the loader calls _dl_debug_state after each change of its object list, with r_state
        RT_CONSISTENT once the list is complete; a temporary int3 there, the original byte and
        rip put back at the hit. A loader without those symbols: the program's entry point
        (AT_ENTRY; the libraries' initializers have run by then). A static program needs no
        stop. Returns how it stopped ("rendezvous", "entry", "exec"). Raises PymtraceError if
        the command ends on the way (a library its loader cannot find)."""
        try:
            return _run_until_loaded(self.pid, self.exe)
        except _Ended as ended:
            self.proc.returncode = ended.code
            raise PymtraceError(
                f"{self.argv[0]} exited before its libraries were loaded (status {ended.code})"
            ) from None
        except OSError as exc:  # a ptrace request refused: the command is not usable
            raise PymtraceError(f"cannot follow {self.argv[0]} to its loaded libraries: {exc}") from None

    def libc_path(self) -> str | None:
        """The libc the command will map (it is not mapped yet: the loader has not run)."""
        return predict_libc(self.argv, self.exe)

    def resume(self, hold_exit: bool = False, on_exec: Callable[[int], None] | None = None) -> None:
        """Let the command run. HOLD_EXIT: stay its ptrace tracer, only so that the kernel
        stops it once more when it exits, before its memory mappings are torn down (heap
        reads its maps then: the libraries a short-lived command loaded are not lost).
        ON_EXEC: stay its tracer so that each exec stops it; it is then run until its new
        loader has mapped its objects (run_until_loaded) and ON_EXEC(pid) is called before it
        goes on (the caller attaches probes to the new program's allocator). Either way the
        caller must then call service() regularly from this same thread (the tracer), and
        release() to let it go on untraced."""
        if self.resumed:
            return
        self.resumed = True
        if hold_exit or on_exec is not None:
            options = _PTRACE_O_TRACEEXEC  # an exec is an event, not a SIGTRAP
            if hold_exit:
                options |= _PTRACE_O_TRACEEXIT
            if _libc.ptrace(_PTRACE_SETOPTIONS, self.pid, None, ctypes.c_void_p(options)) == 0:
                self.held = True
                self.hold_exit = hold_exit
                self.on_exec = on_exec
                _libc.ptrace(_PTRACE_CONT, self.pid, None, None)
                return
        _libc.ptrace(_PTRACE_DETACH, self.pid, None, None)

    def release(self) -> None:
        """A held command still running: stop being its tracer, let it go on untraced. It is
        stopped for that (a SIGSTOP, suppressed at its delivery: PTRACE_DETACH needs a stopped
        tracee); signals that reach it meanwhile are passed on."""
        if not self.held:
            return
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        while self.held:
            try:
                pid, status = os.waitpid(self.pid, _WALL)
            except ChildProcessError:
                self.held = False
                return
            if not os.WIFSTOPPED(status):
                self.held = False
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                return
            signum, event = os.WSTOPSIG(status), status >> 16
            if signum == signal.SIGSTOP and event == 0:
                _libc.ptrace(_PTRACE_DETACH, pid, None, None)  # its SIGSTOP dropped
                self.held = False
            elif signum == signal.SIGTRAP and event in (_PTRACE_EVENT_EXEC, _PTRACE_EVENT_EXIT):
                _libc.ptrace(_PTRACE_CONT, pid, None, None)  # our SIGSTOP is still on its way
            else:
                _libc.ptrace(_PTRACE_CONT, pid, None, ctypes.c_void_p(signum))

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
                self._exec_stop()
            else:  # a signal on its way to the command: deliver it (a group-stop, reported once
                # the stop signal was delivered, is resumed: the kernel ignores the signal given
                # then, so a held command does not stay stopped: docs/heap.md)
                _libc.ptrace(_PTRACE_CONT, self.pid, None, ctypes.c_void_p(signum))

    def _exec_stop(self) -> None:
        """At an exec stop: run the new program until its objects are mapped, tell on_exec,
        go on. A program that ends on the way is reported by the next service()."""
        if self.on_exec is not None:
            try:
                _run_until_loaded(self.pid, proc.exe(self.pid) or self.exe)
            except _Ended as ended:
                self.held = False
                self.proc.returncode = ended.code
                return
            except OSError:  # gone meanwhile (killed): its end is reported by waitpid
                pass
            else:
                try:
                    self.on_exec(self.pid)
                finally:  # also when it raises: the command must not stay stopped
                    _libc.ptrace(_PTRACE_CONT, self.pid, None, None)
                return
        _libc.ptrace(_PTRACE_CONT, self.pid, None, None)

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


# ---------------------------------------------------------------- stopping at the loaded program


class _Ended(Exception):
    """The traced command ended while being run to a stop (CODE: its exit status)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _peek(pid: int, address: int) -> int:
    ctypes.set_errno(0)
    word = _libc.ptrace(_PTRACE_PEEKDATA, pid, ctypes.c_void_p(address), None)
    if word == -1 and ctypes.get_errno():
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return word & 0xFFFFFFFFFFFFFFFF


def _poke(pid: int, address: int, word: int) -> None:
    if _libc.ptrace(_PTRACE_POKEDATA, pid, ctypes.c_void_p(address), ctypes.c_void_p(word)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _regs(pid: int) -> ctypes.Array:
    regs = (ctypes.c_ulong * 27)()  # struct user_regs_struct (x86-64)
    if _libc.ptrace(_PTRACE_GETREGS, pid, None, ctypes.byref(regs)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return regs


def _set_rip(pid: int, rip: int) -> None:
    regs = _regs(pid)
    regs[_RIP] = rip
    if _libc.ptrace(_PTRACE_SETREGS, pid, None, ctypes.byref(regs)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _auxv(pid: int) -> dict[int, int]:
    with open(f"/proc/{pid}/auxv", "rb") as f:
        raw = f.read()
    words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw) - 15, 16)]
    values = [int.from_bytes(raw[i + 8 : i + 16], "little") for i in range(0, len(raw) - 15, 16)]
    return dict(zip(words, values))


def _step(pid: int, request: int, trap_at: int | None) -> None:
    """Resume PID with REQUEST (PTRACE_CONT/SINGLESTEP) until it stops with a SIGTRAP (at rip
    TRAP_AT, when given); any other signal is passed on to it. Raises _Ended if it ends."""
    signum = 0
    while True:
        if _libc.ptrace(request, pid, None, ctypes.c_void_p(signum)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        _, status = os.waitpid(pid, _WALL)
        if not os.WIFSTOPPED(status):
            raise _Ended(os.waitstatus_to_exitcode(status))
        signum = os.WSTOPSIG(status)
        if signum == signal.SIGTRAP and status >> 16 == 0:
            if trap_at is None or _regs(pid)[_RIP] == trap_at:
                return
        elif signum == signal.SIGTRAP:
            signum = 0  # a ptrace event stop (none is asked for here): nothing to deliver


def _run_to(pid: int, address: int) -> None:
    """Run PID until it is about to execute ADDRESS (a temporary int3 there, then the original
    byte and rip put back)."""
    word = _peek(pid, address)
    _poke(pid, address, (word & ~0xFF) | 0xCC)
    try:
        _step(pid, _PTRACE_CONT, address + 1)
    finally:
        try:
            _poke(pid, address, word)
        except OSError:  # it ended: nothing to put back
            pass
    _set_rip(pid, address)


def _loader(pid: int, exe: str) -> tuple[str, int] | None:
    """(path, load address) of PID's dynamic loader: the interpreter the kernel mapped
    (AT_BASE), or the program itself when it is the loader (`ld.so PROG`); None: static."""
    base = _auxv(pid).get(_AT_BASE, 0)
    maps = libc.read_maps(pid)
    if base:
        for m in maps:
            if m.start == base and m.path.startswith("/"):
                return libc.host_path(pid, m.path), base
        return None
    if elf.interpreter(exe) is None and re.search(r"/ld-(linux|musl)[^/]*\.so", os.path.realpath(exe)):
        real = os.path.realpath(exe)
        starts = [m.start for m in maps if m.offset == 0 and m.path and os.path.realpath(m.path) == real]
        if starts:
            return exe, min(starts)
    return None


def _run_until_loaded(pid: int, exe: str) -> str:
    """Launched.run_until_loaded for the stopped process PID running EXE."""
    loader = _loader(pid, exe)
    if loader is None:
        return "exec"  # a static program: everything is mapped at exec
    path, base = loader
    try:
        brk = base + elf.symbol(path, "_dl_debug_state").address
        r_state = base + elf.symbol(path, "_r_debug").address + 24  # struct r_debug's r_state
    except PymtraceError:
        entry = _auxv(pid).get(_AT_ENTRY, 0)
        if not entry or _regs(pid)[_RIP] == entry:
            return "exec"
        _run_to(pid, entry)
        return "entry"
    for _ in range(_RENDEZVOUS_HITS):
        _run_to(pid, brk)
        if _peek(pid, r_state) & 0xFFFFFFFF == _RT_CONSISTENT:
            return "rendezvous"
        _step(pid, _PTRACE_SINGLESTEP, None)  # over its `ret`, then on to the next change
    return "rendezvous"
