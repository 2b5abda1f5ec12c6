"""Process fork/exec/exit notifications from the kernel's process-events connector (cn_proc).

A small wrapper around pyroute2's ProcEventSocket that reads in a background thread:

    from pymtrace.procevents import ProcEvents
    with ProcEvents(on_event=lambda ev: print(ev)) as pe:   # callback runs in the thread
        ...
        for ev in pe.drain():                               # or poll the queue
            if ev.kind == "exit" and ev.pid == ev.tgid: ...

Events are ProcEvent(kind, pid, tgid, parent_tgid, exit_code, time):
  kind "fork": pid/tgid are the CHILD's (a new thread when pid != tgid), parent_tgid the parent;
  kind "exec": the process that exec'd;
  kind "exit": a task exited; the process (thread group) is gone when pid == tgid
               (its leader exited; check /proc/TGID if other threads may outlive it).
Needs root (CAP_NET_ADMIN). If the connector is unavailable, ProcEvents(...).start() raises
PymtraceError; callers that can live without it (periodic /proc scans) may catch that.
"""
import collections
import queue
import select
import threading
import time

from pymtrace.errors import PymtraceError

ProcEvent = collections.namedtuple("ProcEvent", "kind pid tgid parent_tgid exit_code time")

_KINDS = {"PROC_EVENT_FORK": "fork", "PROC_EVENT_EXEC": "exec", "PROC_EVENT_EXIT": "exit"}


def _decode(msg):
    kind = _KINDS.get(msg.get("event"))
    if kind is None:
        return None
    now = time.monotonic()
    if kind == "fork":
        return ProcEvent(kind, msg["child_pid"], msg["child_tgid"], msg["parent_tgid"], None, now)
    if kind == "exec":
        return ProcEvent(kind, msg["process_pid"], msg["process_tgid"], None, None, now)
    return ProcEvent(kind, msg["process_pid"], msg["process_tgid"], msg.get("parent_tgid"),
                     msg.get("exit_code"), now)


class ProcEvents:
    """Background reader of cn_proc events. kinds: which of fork/exec/exit to keep."""

    def __init__(self, on_event=None, kinds=("fork", "exec", "exit"), maxqueue=100000):
        self.on_event = on_event
        self.kinds = frozenset(kinds)
        self.queue = queue.Queue(maxqueue)
        self.dropped = 0  # events lost because the queue was full (nobody drained it)
        self._sock = None
        self._thread = None
        self._stop = threading.Event()

    def start(self):
        try:
            from pyroute2 import ProcEventSocket

            sock = ProcEventSocket()
            sock.bind()
            sock.control(listen=True)
        except Exception as exc:
            raise PymtraceError(f"cannot listen to process events (cn_proc): {exc}") from None
        self._sock = sock
        self._thread = threading.Thread(target=self._loop, name="pymtrace-procevents", daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        sock = self._sock
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([sock], [], [], 0.2)
                if not ready:
                    continue
                msgs = sock.get()
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.1)
                continue
            for msg in msgs:
                ev = _decode(msg)
                if ev is None or ev.kind not in self.kinds:
                    continue
                if self.on_event is not None:
                    try:
                        self.on_event(ev)
                    except Exception:
                        pass
                try:
                    self.queue.put_nowait(ev)
                except queue.Full:
                    self.dropped += 1

    def drain(self):
        """All events queued so far (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            try:
                self._sock.close()
            except Exception:
                pass
            self._sock = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
