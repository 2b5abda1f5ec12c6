"""The hottest allocation call sites of a few processes, live, for `pymtrace top --stacks`
(view 5): the heap sampler (sources.heap.HeapSource through sources.heapsession.HeapSession)
aggregated per stack and per call site, as cumulative snapshot values.

    c = StackSitesSource([pid], sample_bytes=524288)
    c.attach()              # images of the processes, compile heap.bpf.c, probes; a reader thread
    snap = c.snapshot()     # {"stacks": {pid: StackProcess}, "lost": {"heap_...": n}}
    c.close()

A *call site* is the first frame of a stack outside the allocator (glibc's libc, libstdc++'s
operator new): the return address in the code that asked for memory; in a Python process
(its Python frames merged in: sources.heapsession), the innermost Python frame. Each sample is weighted as
in `pymtrace heap` (1/p allocations, size/p bytes, p = 1 - exp(-size/sample_bytes)), so the
cumulative values are unbiased estimates and their differences over an interval are rates.
"In use" is the weighted sum of the sampled blocks not freed when the snapshot is taken.

Bounded work: at most MAX_STACKS distinct stacks per process are kept (later new stacks are
counted under one OTHER_SITE row, and said so); a stack is symbolized once, when a snapshot
first shows it (tracee.unwind.Symbolizer caches each location); only the samples of blocks
still live are remembered (the BPF table of live sampled blocks bounds them).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pymtrace.sources.base import Comms
from pymtrace.sources.heap import DEFAULT_SAMPLE_BYTES
from pymtrace.sources.heapprofile import StackValues, sample_weight
from pymtrace.sources.heapsession import HeapSession
from pymtrace.sources.snapshot import StackFrame, StackProcess, StackSite
from pymtrace.tracee.pyframes import PYTHON
from pymtrace.tracee.unwind import UNKNOWN, Location, Module, Symbolizer

MAX_STACKS = 500  # distinct stacks kept per process
OTHER_SITE = "[other stacks]"  # the site key and name of samples beyond MAX_STACKS
POLL_MS = 10  # the reader's wait for ring-buffer records
LIVE_GRACE_NS = 1_000_000_000  # a sample younger than this may not have reached the live table yet
# how long a snapshot waits for the reader to take the samples written before it (milliseconds
# normally; seconds where unwinding is slow, as in an emulated VM)
CATCH_UP_S = 5.0
ALLOCATOR_FILES = ("libc.so", "libc-", "libstdc++.so", "libc_malloc_debug.so")


def allocator_module(module: Module) -> bool:
    """MODULE is the allocator's code (glibc's libc, libstdc++'s operator new): not a call site."""
    return os.path.basename(module.path).startswith(ALLOCATOR_FILES)


def call_site(stack: tuple[Location, ...]) -> Location | None:
    """The innermost Python frame of STACK (leaf first), the line that allocated; else its
    first location outside the allocator; the outermost one when every frame is in it (libc's
    own allocation from its start-up code); None if empty."""
    for loc in stack:
        if loc[0] == PYTHON:
            return loc
    for loc in stack:
        if not allocator_module(loc[0]):
            return loc
    return stack[-1] if stack else None


def site_key(loc: Location | None) -> str:
    """A stable text key of a call site (the same in every snapshot)."""
    if loc is None:
        return "[no stack]"
    module, pc = loc
    return f"{module.path}+0x{pc:x}"


@dataclass
class _Stack:
    """One distinct stack of one process and its cumulative weighted values."""

    ident: int
    stack: tuple[Location, ...]
    site: str
    site_loc: Location | None
    values: StackValues  # alloc_objects, alloc_space, samples, complete (in-use: per snapshot)
    frames: list[StackFrame] | None = None  # root to leaf, filled at the first snapshot showing it


@dataclass
class _Process:
    stacks: dict[tuple[Location, ...], _Stack] = field(default_factory=dict)
    other: _Stack | None = None  # samples of stacks beyond MAX_STACKS
    samples: int = 0
    complete_samples: int = 0
    overflow_samples: int = 0


class SiteAggregator:
    """Samples of several processes aggregated per stack (HeapSession's sample sink; thread-safe:
    the reader thread adds while snapshots read)."""

    def __init__(self, sample_bytes: int, max_stacks: int = MAX_STACKS) -> None:
        self.sample_bytes = sample_bytes
        self.max_stacks = max_stacks
        self.processes: dict[int, _Process] = {}
        # sample id -> pid, stack, size, ts, weight, complete
        self._pending: dict[int, tuple[int, _Stack, int, int, float, bool]] = {}
        self._next_ident = 1
        self._lock = threading.Lock()

    def add_sample(
        self, pid: int, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int, complete: bool
    ) -> None:
        """Count one sample of PID: SIZE bytes allocated at TS_NS through STACK (leaf first)."""
        weight = sample_weight(size, self.sample_bytes)
        with self._lock:
            proc = self.processes.setdefault(pid, _Process())
            entry = proc.stacks.get(stack)
            if entry is None:
                if len(proc.stacks) < self.max_stacks:
                    loc = call_site(stack)
                    values = StackValues(stack)
                    entry = proc.stacks[stack] = _Stack(self._next_ident, stack, site_key(loc), loc, values)
                    self._next_ident += 1
                else:
                    if proc.other is None:
                        proc.other = _Stack(0, (), OTHER_SITE, None, StackValues(()))
                    entry = proc.other
                    proc.overflow_samples += 1
            entry.values.count(size, weight, complete)
            proc.samples += 1
            proc.complete_samples += bool(complete)
            self._pending[sample_id] = (pid, entry, size, ts_ns, weight, complete)

    def snapshot(
        self,
        live_ids: Iterable[int] | Callable[[], Iterable[int]],
        now_ns: int,
        symbolizer: Symbolizer,
        comms: Callable[[int], str] | None = None,
        until_ns: int | None = None,
    ) -> dict[int, StackProcess]:
        """{pid: StackProcess}: cumulative values, in-use values of the samples in LIVE_IDS (the
        sampled blocks not freed when they were read, at NOW_NS); samples neither live nor
        younger than LIVE_GRACE_NS are forgotten (freed). LIVE_IDS may be a function: it is
        then called after the samples are taken, so that a sample the reader adds meanwhile
        is not counted as allocated but not in use (a leak would read as partly freed).
        UNTIL_NS: only the samples taken up to then (CLOCK_MONOTONIC, as top's counters' "time"):
        the values then cover the calls top's counters read (the later samples count in the next
        snapshot), however long reading the counters took before."""
        with self._lock:  # a copy of the values; symbolizing below must not stall the reader
            pending = list(self._pending.items())
            copies = []
            for pid, proc in self.processes.items():
                entries = list(proc.stacks.values()) + ([proc.other] if proc.other is not None else [])
                values = [
                    (e, e.values.alloc_objects, e.values.alloc_space, e.values.samples, e.values.complete)
                    for e in entries
                ]
                counts = (proc.samples, proc.complete_samples, len(proc.stacks), proc.overflow_samples)
                copies.append((pid, values, counts))
        live = set(live_ids() if callable(live_ids) else live_ids)
        inuse: dict[int, list[float]] = {}  # id(stack) -> [objects, bytes]
        later: dict[int, list[float]] = {}  # id(stack) -> [objects, bytes, samples] taken after UNTIL_NS
        later_procs: dict[int, list[int]] = {}  # pid -> [samples, complete, overflow] taken after it
        forget_before = now_ns - LIVE_GRACE_NS if until_ns is None else min(now_ns - LIVE_GRACE_NS, until_ns)
        forgotten = []
        for sample_id, (pid, entry, size, ts_ns, weight, complete) in pending:
            if until_ns is not None and ts_ns > until_ns:
                acc = later.setdefault(id(entry), [0.0, 0.0, 0])
                acc[0] += weight
                acc[1] += weight * size
                acc[2] += 1
                counts = later_procs.setdefault(pid, [0, 0, 0])
                counts[0] += 1
                counts[1] += bool(complete)
                counts[2] += entry.ident == 0  # the [other stacks] entry
            elif sample_id in live:
                acc = inuse.setdefault(id(entry), [0.0, 0.0])
                acc[0] += weight
                acc[1] += weight * size
            elif ts_ns < forget_before:
                forgotten.append(sample_id)
        with self._lock:
            for sample_id in forgotten:
                self._pending.pop(sample_id, None)
        out: dict[int, StackProcess] = {}
        for pid, values, (samples, complete_samples, kept, overflow) in copies:
            late = later_procs.get(pid, (0, 0, 0))
            samples, complete_samples, overflow = samples - late[0], complete_samples - late[1], overflow - late[2]
            sites: dict[str, StackSite] = {}
            for entry, alloc_objects, alloc_bytes, nsamples, complete in values:
                if id(entry) in later:
                    late_objects, late_bytes, late_samples = later[id(entry)]
                    alloc_objects, alloc_bytes, nsamples = (
                        alloc_objects - late_objects,
                        alloc_bytes - late_bytes,
                        nsamples - int(late_samples),
                    )
                if entry.frames is None:  # once per stack (only this thread sets it)
                    entry.frames = _frames(entry.stack, symbolizer)
                site = sites.get(entry.site)
                if site is None:
                    site = sites[entry.site] = _new_site(entry, symbolizer)
                objects, nbytes = inuse.get(id(entry), (0.0, 0.0))
                site["alloc_objects"] += alloc_objects
                site["alloc_bytes"] += alloc_bytes
                site["inuse_objects"] += objects
                site["inuse_bytes"] += nbytes
                site["samples"] += nsamples
                site["stacks"].append(
                    {
                        "id": entry.ident,
                        "alloc_objects": alloc_objects,
                        "alloc_bytes": alloc_bytes,
                        "inuse_objects": objects,
                        "inuse_bytes": nbytes,
                        "samples": nsamples,
                        "complete": complete,
                        "frames": entry.frames,
                    }
                )
            out[pid] = {
                "pid": pid,
                "comm": comms(pid) if comms is not None else "?",
                "sample_bytes": self.sample_bytes,
                "samples": samples,
                "complete_samples": complete_samples,
                "stacks_kept": kept,
                "max_stacks": self.max_stacks,
                "overflow_samples": overflow,
                "sites": sites,
            }
        return out

    def remembered(self) -> int:
        """How many samples are remembered (those that may still be live)."""
        with self._lock:
            return len(self._pending)


def _frames(stack: tuple[Location, ...], symbolizer: Symbolizer) -> list[StackFrame]:
    """STACK (leaf first) as symbolized frames from the root to the leaf."""
    frames: list[StackFrame] = []
    for loc in reversed(stack):
        module = loc[0]
        for f in reversed(symbolizer.frames(loc)):
            frames.append(
                {
                    "function": f.function,
                    "module": os.path.basename(module.path) if module is not UNKNOWN else "[unknown]",
                    "file": f.file,
                    "line": f.line,
                    "inlined": f.inlined,
                }
            )
    return frames


def _new_site(entry: _Stack, symbolizer: Symbolizer) -> StackSite:
    if entry.site_loc is None:
        function, module, offset = entry.site, "", 0
    else:
        loc_module, offset = entry.site_loc
        # the innermost frame of the location: an inlined callee that called malloc is the site
        function = symbolizer.frames(entry.site_loc)[0].function
        module = os.path.basename(loc_module.path) if loc_module is not UNKNOWN else "[unknown]"
    return {
        "function": function,
        "module": module,
        "offset": offset,
        "alloc_objects": 0.0,
        "alloc_bytes": 0.0,
        "inuse_objects": 0.0,
        "inuse_bytes": 0.0,
        "samples": 0,
        "stacks": [],
    }


class StackSitesSource:
    """The heap sampler on PIDS, aggregated per call site, with a reader thread (module
    docstring). Errors of attach are pymtrace.errors' (no libdw, a PID gone, no root)."""

    what = "sampling allocation call stacks"

    def __init__(
        self, pids: Iterable[int], sample_bytes: int = DEFAULT_SAMPLE_BYTES, max_stacks: int = MAX_STACKS
    ) -> None:
        self.pids = sorted(set(pids))
        self.sites = SiteAggregator(sample_bytes, max_stacks)
        self.session = HeapSession(self.pids, sample_bytes=sample_bytes, sink=self._sample)
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._error: BaseException | None = None
        self.comms = Comms()

    def _sample(
        self, pid: int, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int, complete: bool
    ) -> None:
        self.sites.add_sample(pid, sample_id, stack, size, ts_ns, complete)

    def attach(self) -> StackSitesSource:
        """Capture the processes' images, compile and attach heap.bpf.c, start the reader."""
        try:
            self.session.attach()
        except BaseException:
            self.session.close()
            raise
        self._reader = threading.Thread(target=self._read, name="pymtrace-stacks", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        # samples are unwound as they come: the ring buffer (16 MiB) must not fill up
        while not self._stop.is_set():
            try:
                self.session.poll(POLL_MS)
            except BaseException as exc:  # raised again by snapshot(), in top's thread
                self._error = exc
                return

    def snapshot(self, until: float | None = None) -> dict[str, Any]:
        """{"stacks": {pid: StackProcess}, "lost": {"heap_<counter>": n}}; UNTIL (a
        time.monotonic() value: top's counters' "time"): the samples taken up to then only
        (SiteAggregator.snapshot). Raises what the reader met (a PymtraceError of the unwinder)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        source = self.session.source
        self._catch_up(source.written())
        now_ns = time.monotonic_ns()
        stacks = self.sites.snapshot(
            lambda: source.live().keys(),
            now_ns,
            self.session.symbolizer,
            self.comms.get,
            until_ns=None if until is None else int(until * 1e9),
        )
        return {"stacks": stacks, "lost": {f"heap_{k}": v for k, v in source.drops().items()}}

    def _catch_up(self, pos: int) -> None:
        """Wait (at most CATCH_UP_S) until the reader has taken every sample written before
        ring position POS. The view's rates then cover the same calls as top's counters read
        just before (rates from samples still waiting in the ring would lag behind them)."""
        deadline = time.monotonic() + CATCH_UP_S
        reader = self._reader
        while not self.session.source.handed_over(pos) and time.monotonic() < deadline:
            if reader is None or not reader.is_alive():
                return
            time.sleep(POLL_MS / 1000)

    def close(self) -> None:
        """Stop the reader, detach every probe; safe to call twice."""
        self._stop.set()
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        self.session.close()
