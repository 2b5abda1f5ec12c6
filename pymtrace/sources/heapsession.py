"""One `pymtrace heap` run below the command: samples from HeapSource (BPF) unwound by each
process's ProcessImage (tracee.unwind) into a HeapProfile (sources.heapprofile).

    session = HeapSession(pids, sample_bytes=..., meta={...})
    session.attach()                 # images of the running processes, then the probes
    while running:
        session.poll(10)             # samples are unwound as they arrive
    profile = session.finish(older_s=None)   # in-use blocks read, probes detached
    symbolizer = session.symbolizer          # names for the writers (files kept open)

Images: a process given at the start is captured before the probes go on; a fork child when
its fork is reported; after an exec the new program is captured at once. A sample whose stack
reaches a pc in no captured file (a library mapped since: the loader at start, a dlopen)
makes the image re-read the process's maps, at most every REFRESH_S per process, and the
stack is unwound again. A process that exits before pymtrace read its maps (it lived less
than a poll interval) keeps its samples, as one unknown frame each: counted as incomplete
stacks, never dropped.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from pymtrace.sources.heap import DEFAULT_SAMPLE_BYTES, DEFAULT_STACK_BYTES, HeapSample, HeapSource
from pymtrace.sources.heapprofile import HeapProfile
from pymtrace.tracee.unwind import UNKNOWN, Location, ProcessImages

# sink(pid, sample_id, stack leaf first, size, ts_ns, complete): where samples go instead of the
# HeapProfile (top's live call sites: sources.stacksites)
SampleSink = Callable[[int, int, "tuple[Location, ...]", int, int, bool], None]

REFRESH_S = 0.02  # at most one re-read of a process's maps per this many seconds


class HeapSession:
    """Samples of PIDS unwound into a HeapProfile (see the module docstring)."""

    def __init__(
        self,
        pids: Iterable[int],
        sample_bytes: int = DEFAULT_SAMPLE_BYTES,
        stack_bytes: int = DEFAULT_STACK_BYTES,
        follow_forks: bool = False,
        meta: dict[str, Any] | None = None,
        libc_path: str | None = None,
        sink: SampleSink | None = None,
        ring_pages: int | None = None,
        max_live: int | None = None,
    ) -> None:
        self.pids = sorted(set(pids))
        self.profile = HeapProfile(sample_bytes, meta)
        self.sink = sink  # None: samples go into self.profile
        self.processes = ProcessImages(REFRESH_S)
        self.symbolizer = self.processes.symbolizer
        self.source = HeapSource(
            self.pids,
            sample_bytes=sample_bytes,
            stack_bytes=stack_bytes,
            follow_forks=follow_forks,
            on_sample=self._sample,
            on_exec=self._exec,
            images=self.processes,
            on_stack=self._cached,
            on_free=self.profile.freed if sink is None else None,
            on_fork=self._fork,
            libc_path=libc_path,
            ring_pages=ring_pages,
            max_live=max_live,
        )

    # -- lifecycle
    def attach(self) -> None:
        """Capture the processes' images (a launched command stopped before its loader ran:
        its executable and loader; the rest when a stack first reaches it), then attach."""
        for pid in self.pids:
            self.processes.capture(pid, required=True)
        self.source.attach()

    def probe_program(self, pid: int) -> None:
        """A launched command after an exec, its objects mapped (tracee.launch's on_exec):
        its new program's allocator probed too (HeapSource.probe_program); raises
        PymtraceError when it cannot be."""
        self.source.probe_program(pid)

    def poll(self, timeout_ms: int = 10) -> None:
        self.source.poll(timeout_ms)

    def finish(self, older_s: float | None = None, end_ns: int | None = None) -> HeapProfile:
        """Drain what is left, read the blocks still in use, detach; the finished profile.
        END_NS (CLOCK_MONOTONIC, like the BPF timestamps; default now) is "the end" that
        --older counts back from: when the run stopped, not when detaching is done."""
        if end_ns is None:
            end_ns = time.monotonic_ns()
        try:
            self.source.drain()
            live = set(self.source.live())
            drops = self.source.drops()
        finally:
            self.source.close()
        self.profile.finish(live, end_ns, older_s, drops=drops)
        return self.profile

    def close(self) -> None:
        self.source.close()

    # -- source callbacks (inside poll)
    def _sample(self, s: HeapSample) -> None:
        unwound = self.processes.unwind(s.pid, s.tid, s.regs, s.stack, s.stack_len)
        if unwound is None:  # gone before its maps could be read: an incomplete one-frame stack
            self._add(s, ((UNKNOWN, s.regs[0]),), False)
            return
        stack, complete = unwound
        self._add(s, stack, complete)

    def _cached(self, pid: int, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int) -> None:
        """A sample whose (complete) stack the unwind cache knew: no unwinding, no HeapSample."""
        if self.sink is not None:
            self.sink(pid, sample_id, stack, size, ts_ns, True)
        else:
            self.profile.add(sample_id, stack, size, ts_ns, True)

    def _add(self, s: HeapSample, stack: tuple[Location, ...], complete: bool) -> None:
        if self.sink is not None:
            self.sink(s.pid, s.sample_id, stack, s.size, s.ts_ns, complete)
        else:
            self.profile.add(s.sample_id, stack, s.size, s.ts_ns, complete)

    def at_exit(self, pid: int) -> None:
        """PID is exiting but its mappings are still there (a launched command held at its
        exit, tracee.launch): capture every file it mapped since its image was read."""
        self.processes.at_exit(pid)

    def _exec(self, pid: int) -> None:
        self.processes.forget(pid)
        self.processes.capture(pid)

    def _fork(self, parent: int, child: int) -> None:
        self.processes.capture(child)
