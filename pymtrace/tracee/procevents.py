"""Process fork/exec/exit notifications from the kernel's process-events connector (cn_proc).

A small reader of the connector pyroute2's ProcEventSocket wraps, in a background thread:

    from pymtrace.tracee.procevents import ProcEvents
    with ProcEvents(on_event=lambda ev: print(ev)):    # callback runs in the thread
        ...
    with ProcEvents() as pe:                             # or, without a callback, poll the queue
        for ev in pe.drain():
            if ev.kind == "exit" and ev.pid == ev.tgid: ...

Events are ProcEvent(kind, pid, tgid, parent_tgid, exit_code, time):
  kind "fork": pid/tgid are the CHILD's (a new thread when pid != tgid), parent_tgid the parent;
  kind "exec": the process that exec'd;
  kind "exit": a task exited; the process (thread group) is gone when pid == tgid
               (its leader exited; check /proc/TGID if other threads may outlive it).
Needs root (CAP_NET_ADMIN). If the connector is unavailable, ProcEvents(...).start() raises
PymtraceError; callers that can live without it (periodic /proc scans) may catch that.
`overruns` counts receive-buffer overruns (events lost by the kernel under a fork storm):
consumers should still drop state of PIDs missing from /proc now and then.

The netlink socket is read directly (plain socket + struct): pyroute2 0.9's asyncio reader
buffers messages internally, so select() on its socket misses events, and it is bound to
the thread that created it. The message layout is pyroute2's (netlink/connector/cn_proc.py).
"""

from __future__ import annotations

import collections
import errno
import queue
import select
import socket
import struct
import threading
import time
from typing import Callable, Iterable

from pymtrace.errors import PymtraceError

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
NLMSG_DONE = 3
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXEC = 0x2
PROC_EVENT_EXIT = 0x80000000

_NLMSGHDR = struct.Struct("=IHHII")
_CN_MSG = struct.Struct("=IIIIHH")
_EVENT = struct.Struct("=IIQ")

ProcEvent = collections.namedtuple("ProcEvent", "kind pid tgid parent_tgid exit_code time")


def _control(action: int) -> bytes:
    payload = struct.pack("=I", action)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def parse(data: bytes, now: float | None = None) -> list[ProcEvent]:
    """ProcEvents from one netlink datagram (fork, exec and exit only)."""
    now = time.monotonic() if now is None else now
    out = []
    pos = 0
    while pos + _NLMSGHDR.size <= len(data):
        length = _NLMSGHDR.unpack_from(data, pos)[0]
        if length < _NLMSGHDR.size:
            break
        body = pos + _NLMSGHDR.size
        ev_at = body + _CN_MSG.size
        if ev_at + _EVENT.size <= pos + length:
            what = _EVENT.unpack_from(data, ev_at)[0]
            d = ev_at + _EVENT.size
            try:
                if what == PROC_EVENT_FORK:
                    ppid, ptgid, cpid, ctgid = struct.unpack_from("=IIII", data, d)
                    out.append(ProcEvent("fork", cpid, ctgid, ptgid, None, now))
                elif what == PROC_EVENT_EXEC:
                    pid, tgid = struct.unpack_from("=II", data, d)
                    out.append(ProcEvent("exec", pid, tgid, None, None, now))
                elif what == PROC_EVENT_EXIT:
                    pid, tgid, code, _sig, _ppid, ptgid = struct.unpack_from("=IIIIII", data, d)
                    out.append(ProcEvent("exit", pid, tgid, ptgid, code, now))
            except struct.error:
                pass
        pos += (length + 3) & ~3
    return out


class ProcEvents:
    """Background reader of cn_proc events. kinds: which of fork/exec/exit to keep. Events go
    to on_event when given, else to the queue drain() empties (a long-running watcher with a
    callback must not fill a queue nobody reads)."""

    def __init__(
        self,
        on_event: Callable[[ProcEvent], None] | None = None,
        kinds: Iterable[str] = ("fork", "exec", "exit"),
        maxqueue: int = 100000,
    ) -> None:
        self.on_event = on_event
        self.kinds = frozenset(kinds)
        self.queue = queue.Queue(maxqueue)
        self.dropped = 0  # events lost because the queue was full (nobody drained it)
        self.callback_errors = 0  # on_event calls that raised (the reader thread goes on)
        self.last_callback_error = None  # the last such exception, for whoever diagnoses it
        self.overruns = 0  # kernel-side losses (ENOBUFS)
        self._sock = None
        self._thread = None
        self._stop = threading.Event()

    def start(self) -> ProcEvents:
        # pyroute2 (0.9) binds a socket to the thread that created it: create, read and close
        # it all in the background thread; wait here until it listens (or failed).
        self._ready = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="pymtrace-procevents", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self._ready.is_set():
            self.stop()
            raise PymtraceError(f"cannot listen to process events (cn_proc): {self._error or 'timeout'}")
        return self

    def _run(self) -> None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            except OSError:
                pass
            sock.bind((0, CN_IDX_PROC))
            sock.send(_control(PROC_CN_MCAST_LISTEN))
        except Exception as exc:  # raised to the caller of start() (it waits on _ready)
            self._error = exc
            self._ready.set()
            return
        self._sock = sock
        self._ready.set()
        try:
            self._loop(sock)
        finally:
            try:
                sock.send(_control(PROC_CN_MCAST_IGNORE))
            except OSError:
                pass
            sock.close()
            self._sock = None

    def _loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([sock], [], [], 0.2)
                if not ready:
                    continue
                data = sock.recv(65536)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.overruns += 1
                    continue
                if self._stop.is_set():
                    return
                time.sleep(0.1)
                continue
            for ev in parse(data):
                if ev.kind not in self.kinds:
                    continue
                if self.on_event is not None:
                    try:
                        self.on_event(ev)
                    except Exception as exc:  # a consumer's bug must not stop exit tracking
                        self.callback_errors += 1
                        self.last_callback_error = exc
                    continue
                try:
                    self.queue.put_nowait(ev)
                except queue.Full:
                    self.dropped += 1

    def drain(self) -> list[ProcEvent]:
        """All events queued so far (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def __enter__(self) -> ProcEvents:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
