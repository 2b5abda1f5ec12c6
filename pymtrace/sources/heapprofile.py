"""The heap profile of `pymtrace heap`: sampled allocations aggregated per call stack.

Each sample is one allocation the BPF side chose by Poisson sampling over bytes (on average
one per `sample_bytes` allocated, a block of at least `sample_bytes` always). A sample stands
for 1/p allocations of its size, p = 1 - exp(-size/sample_bytes), the estimator of tcmalloc
and heapprofd: unbiased, and exact (weight 1) when every call is sampled (sample_bytes 1).

Four values per stack, the pprof heap profile's sample types:
  alloc_objects, alloc_space   every sampled allocation (weighted count, weighted bytes);
  inuse_objects, inuse_space   those whose sample id is still live at finish (allocated and
                               not freed at the end), with --older S only those allocated at
                               least S seconds before the end.
Under an overhead budget (WindowedProfile) the samples come from windows and only the alloc
values are estimated, scaled up to the whole run (window_scales).
Stacks are interned by content (the tuple of Locations is the dict key): two different
stacks never merge, and no stack is dropped here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pymtrace.tracee.unwind import Frame, Location

VALUE_TYPES = ("alloc_objects", "alloc_space", "inuse_objects", "inuse_space")
ALLOC_TYPES = VALUE_TYPES[:2]
VALUE_UNITS = {"alloc_objects": "count", "alloc_space": "bytes", "inuse_objects": "count", "inuse_space": "bytes"}
DEFAULT_VALUE = "inuse_space"


class FrameSource(Protocol):
    """What the writers need from a symbolizer (tracee.unwind.Symbolizer is one)."""

    def frames(self, loc: Location) -> list[Frame]:  # innermost first
        ...


def sample_weight(size: int, sample_bytes: int) -> float:
    """How many allocations of SIZE one sample stands for: 1/p, p = -expm1(-size/mean);
    1 when every call is sampled (mean <= 1) or the block is always sampled (size >= mean)."""
    if sample_bytes <= 1 or size >= sample_bytes:
        return 1.0
    if size <= 0:
        # malloc(0) samples never come from byte sampling, except with every call sampled
        return 1.0
    return 1.0 / -math.expm1(-size / sample_bytes)


@dataclass
class StackValues:
    """One distinct stack (leaf first) and its four weighted values."""

    stack: tuple[Location, ...]
    alloc_objects: float = 0.0
    alloc_space: float = 0.0
    inuse_objects: float = 0.0
    inuse_space: float = 0.0
    samples: int = 0  # raw samples behind the estimates
    complete: bool = False  # the unwinder reached the outermost frame

    def count(self, size: int, weight: float, complete: bool) -> None:
        """Add one sample of SIZE bytes standing for WEIGHT allocations (sample_weight)."""
        self.alloc_objects += weight
        self.alloc_space += weight * size
        self.samples += 1
        self.complete = self.complete or complete

    def value(self, name: str) -> float:
        """The value called NAME (one of VALUE_TYPES)."""
        if name not in VALUE_TYPES:
            raise ValueError(f"unknown value {name!r}; choose one of {', '.join(VALUE_TYPES)}")
        return getattr(self, name)

    def values(self) -> tuple[int, int, int, int]:
        """The four values rounded to integers, in VALUE_TYPES order (pprof's int64)."""
        return (
            round(self.alloc_objects),
            round(self.alloc_space),
            round(self.inuse_objects),
            round(self.inuse_space),
        )


class HeapProfile:
    """Samples aggregated per stack.

    META describes the run for the writers' titles and comments; keys used: "command" (str),
    "pids" (list of int), "exe" (path of the main executable: pprof's first mapping),
    "time_ns" (wall clock at the start, ns since the epoch), "duration_ns".
    Counters: samples (added), complete_samples (the unwinder reached the outermost frame),
    drops (name -> count: what the source lost; every writer reports them).
    VALUE_TYPES: the values it holds (the writers offer these), DEFAULT_VALUE its first view.
    """

    value_types = VALUE_TYPES
    default_value = DEFAULT_VALUE

    def __init__(self, sample_bytes: int, meta: dict[str, Any] | None = None) -> None:
        self.sample_bytes = sample_bytes
        self.meta: dict[str, Any] = dict(meta or {})
        self.samples = 0
        self.complete_samples = 0
        self.drops: dict[str, int] = {}
        self.older_s: float | None = None
        self.finished = False
        self._stacks: dict[tuple[Location, ...], StackValues] = {}
        # sample id -> (stack, size, ts_ns, weight), kept until finish: whether a sample is
        # still in use is known only at the end (about 210 bytes of Python objects each)
        self._pending: dict[int, tuple[StackValues, int, int, float]] = {}

    def add(self, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int, complete: bool) -> None:
        """Count one sample: SIZE bytes allocated at TS_NS through STACK (leaf first)."""
        entry, weight = self._count(stack, size, complete)
        entry.count(size, weight, complete)
        # kept until finish: whether it is still in use is known only at the end
        self._pending[sample_id] = (entry, size, ts_ns, weight)

    def _count(self, stack: tuple[Location, ...], size: int, complete: bool) -> tuple[StackValues, float]:
        """STACK's entry and the weight of a sample of SIZE on it, counted in the totals."""
        if self.finished:
            raise RuntimeError("HeapProfile.add after finish")
        entry = self._stacks.get(stack)
        if entry is None:
            entry = self._stacks[stack] = StackValues(tuple(stack), complete=complete)
        self.samples += 1
        self.complete_samples += bool(complete)
        return entry, sample_weight(size, self.sample_bytes)

    def freed(self, sample_id: int) -> None:
        """Forget a sample whose block was freed before the end (the source tells each free
        of a sampled block: HeapSource's on_free). It bounds memory by the blocks still
        allocated; a sample not forgotten is kept until finish (about 210 bytes), where the
        live ids decide."""
        self._pending.pop(sample_id, None)

    def finish(
        self,
        live_ids: set[int],
        end_ns: int,
        older_s: float | None = None,
        drops: Mapping[str, int] | None = None,
    ) -> None:
        """Settle the in-use values: the samples in LIVE_IDS (allocated and not freed at
        END_NS), with OLDER_S only those allocated at least OLDER_S seconds before END_NS.
        DROPS (name -> count) are the source's losses, reported by every writer."""
        if self.finished:
            raise RuntimeError("HeapProfile.finish called twice")
        cutoff = end_ns if older_s is None else end_ns - round(older_s * 1e9)
        for sample_id in live_ids:
            sample = self._pending.get(sample_id)
            if sample is None:
                continue  # an allocation whose sample never reached the profile (dropped)
            entry, size, ts_ns, weight = sample
            if ts_ns > cutoff:
                continue
            entry.inuse_objects += weight
            entry.inuse_space += weight * size
        self._pending.clear()
        self.older_s = older_s
        if drops:
            for name, count in drops.items():
                self.drops[name] = self.drops.get(name, 0) + count
        self.finished = True

    def stacks(self) -> Iterator[StackValues]:
        """Every distinct stack, in the order first seen."""
        return iter(self._stacks.values())

    def __len__(self) -> int:
        return len(self._stacks)

    def totals(self) -> dict[str, float]:
        """Each value summed over all stacks."""
        return {name: sum(s.value(name) for s in self._stacks.values()) for name in VALUE_TYPES}

    def dropped(self) -> int:
        """All drops together (non-zero means the profile is missing samples)."""
        return sum(self.drops.values())

    def summary_lines(self) -> list[str]:
        """The run's settings and counters as short lines, for every output format."""
        lines = []
        if self.meta.get("command"):
            lines.append(f"command: {self.meta['command']}")
        if self.meta.get("pids"):
            lines.append("pids: " + " ".join(str(p) for p in self.meta["pids"]))
        lines += [f"traced: {line}" for line in self.meta.get("via", ())]  # which path, per process
        lines += [f"python: {line}" for line in self.meta.get("python", ())]  # its interpreter, per process
        exact = " (every call)" if self.sample_bytes <= 1 else ""
        lines.append(f"sample bytes: {self.sample_bytes}{exact}")
        if self.older_s is not None:
            lines.append(f"in use: only blocks older than {self.older_s:g} s")
        lines.append(f"samples: {self.samples}, complete root-to-leaf: {self.complete_samples}")
        drops = ", ".join(f"{name} {count}" for name, count in sorted(self.drops.items()) if count)
        lines.append(f"drops: {drops or 'none'}")
        if self.meta.get("ring_waits"):  # the interposer's probes waited for heap to read the ring
            lines.append(f"waits for room in the ring: {self.meta['ring_waits']}, {self.meta['ring_wait_s']:.3f} s")
        return lines

    def title(self) -> str:
        """A one-line name of the run: the command, else the PIDs."""
        if self.meta.get("command"):
            return f"pymtrace heap: {self.meta['command']}"
        if self.meta.get("pids"):
            return "pymtrace heap: pid " + ", ".join(str(p) for p in self.meta["pids"])
        return "pymtrace heap"


class Windows(Protocol):
    """When a windowed source's probes were all attached (sources.budget.MeasuredParts)."""

    start_ns: int  # when the windows began: the run the profile estimates

    def part_of(self, ts_ns: int) -> int | None: ...

    def parts(self, now_ns: int) -> list[tuple[int, int]]: ...


def window_scales(parts: Sequence[tuple[int, int]], start_ns: int, end_ns: int) -> list[float]:
    """What each of PARTS ((start, end) ns of the windows' measured parts, in order) stands
    for, in times its own length: the time of the run (START_NS to END_NS) nearer to it than
    to any other part, its edges halfway between parts. A sample in a part counts as many
    allocations; each instant of the run is estimated from the window nearest to it, so
    windows that come more often somewhere stand for less time each there."""
    out = []
    for i, (a, b) in enumerate(parts):
        lo = min(start_ns, a) if i == 0 else (parts[i - 1][1] + a) / 2
        hi = max(end_ns, b) if i == len(parts) - 1 else (b + parts[i + 1][0]) / 2
        out.append((hi - lo) / max(b - a, 1))
    return out


def estimate_error(parts: list[tuple[int, int]]) -> float | None:
    """The relative 95 % error of a total scaled up from PARTS, [(samples, ns)] of each
    window: the samples' count (a Poisson count: 1.96/sqrt(n)) and, from two windows on, the
    spread of their sample rates over the windows' mean (how much the pace moves between
    windows is what the time between them can be off by). None without a sample."""
    n = sum(k for k, _ in parts)
    if not n:
        return None
    error = 1.96**2 / n
    rates = [k / ns for k, ns in parts if ns > 0]
    if len(rates) > 1 and statistics.fmean(rates) > 0:
        error += (1.96 * statistics.stdev(rates) / statistics.fmean(rates)) ** 2 / len(rates)
    return math.sqrt(error)


class WindowedProfile(HeapProfile):
    """A profile sampled in windows (an overhead budget: sources.budget.WindowedHeap): a sample
    counts if it fell in a window's measured part (WINDOWS.part_of: every probe attached),
    scaled at finish by window_scales, so alloc_objects and alloc_space estimate the whole
    run; samples taken while probes were attached or detached are left out (`outside`). The
    in-use values need every free: not measured, not offered (value_types). META["budget"]:
    the source's budget summary (sources.budget.Windows.summary), for summary_lines."""

    value_types = ALLOC_TYPES
    default_value = "alloc_space"

    def __init__(self, sample_bytes: int, windows: Windows, meta: dict[str, Any] | None = None) -> None:
        super().__init__(sample_bytes, meta)
        self.windows = windows
        self.outside = 0
        self.coverage = (0, 0, 0)  # at finish: windows, their measured ns, the run's ns
        self.error: float | None = None  # at finish: the total's relative 95 % error (estimate_error)
        self._parts: dict[int, dict[int, list[Any]]] = {}  # part -> {id(entry): [entry, objects, space]}
        self._counted: dict[int, int] = {}  # part -> samples in it

    def add(self, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int, complete: bool) -> None:
        part = self.windows.part_of(ts_ns)
        if part is None:
            self.outside += 1
            return
        entry, weight = self._count(stack, size, complete)
        entry.samples += 1
        entry.complete = entry.complete or complete
        self._counted[part] = self._counted.get(part, 0) + 1
        cell = self._parts.setdefault(part, {}).setdefault(id(entry), [entry, 0.0, 0.0])
        cell[1] += weight
        cell[2] += weight * size

    def finish(
        self,
        live_ids: set[int],
        end_ns: int,
        older_s: float | None = None,
        drops: Mapping[str, int] | None = None,
    ) -> None:
        """Scale each part's samples (window_scales, the run from WINDOWS.start_ns to END_NS
        or the last part's end); no in-use values (LIVE_IDS, OLDER_S are not used)."""
        parts = self.windows.parts(end_ns)
        start = min([self.windows.start_ns] + [a for a, _ in parts[:1]])
        end = max([end_ns] + [b for _, b in parts[-1:]])
        scales = window_scales(parts, start, end)
        for part, cells in self._parts.items():
            for entry, objects, space in cells.values():
                entry.alloc_objects += objects * scales[part]
                entry.alloc_space += space * scales[part]
        self._parts.clear()
        self.coverage = (len(parts), sum(b - a for a, b in parts), end - start)
        self.error = estimate_error([(self._counted.get(i, 0), b - a) for i, (a, b) in enumerate(parts)])
        super().finish(set(), end_ns, None, drops)

    def summary_lines(self) -> list[str]:
        windows, measured, run = self.coverage
        lines = [
            f"ESTIMATE: alloc_objects and alloc_space scaled up from the samples of {windows} windows covering "
            f"{100 * measured / max(run, 1):.1f}% of {run / 1e9:.2f} s (each standing for the time nearest it); "
            "in-use values not measured (they need every free)",
            "error (95 %) of the total: "
            + ("no sample" if self.error is None else f"+-{100 * self.error:.1f}%")
            + " (the samples' count and the spread of the windows' paces; a stack of n samples: +-196/sqrt(n) %)",
        ]
        budget = self.meta.get("budget")
        if budget:
            cost = budget["cost_seconds"]
            spent = "not measured" if budget["overhead_pct"] is None else f"{budget['overhead_pct']:.2f}%"
            lines.append(
                f"budget: {budget['max_overhead_pct']:g}% of the traced processes' CPU time; measured cost {spent} "
                f"of {budget['traced_cpu_seconds']:.2f} CPU-s (traps {cost['traps']:.3f} s at "
                f"{budget['trap_ns_per_run']:.0f} ns a run calibrated, BPF {cost['bpf']:.3f} s, attach/detach "
                f"{cost['attach_detach']:.3f} s; {budget['probes']}s)"
            )
            lines += [f"budget: {error}" for error in budget.get("errors", ())]
        if self.outside:
            lines.append(f"samples left out: {self.outside} (taken while the probes were being attached or detached)")
        return lines + super().summary_lines()


def frame_label(frame: Frame) -> str:
    """A frame's name in a flame graph: the function; a Python function with its file and
    line, as py-spy names them ("leaf (/app/x.py:12)")."""
    return f"{frame.function} ({frame.file}:{frame.line})" if frame.python else frame.function


def frames_root_first(stack: Sequence[Location], symbolizer: FrameSource) -> list[Frame]:
    """STACK (leaf first, several frames per inlined pc) as frames from the root to the leaf."""
    frames: list[Frame] = []
    for loc in reversed(stack):
        frames.extend(reversed(symbolizer.frames(loc)))
    return frames
