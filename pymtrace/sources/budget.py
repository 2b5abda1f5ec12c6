"""The overhead budget (--max-overhead PCT): malloc's per-call uprobes attached in windows.

A uprobe costs its trap on every call whatever its program does, so the only way to make
tracing cheaper is to have no probe there: WindowedMalloc compiles MallocSource's programs
once and attaches its uprobes for a window (Budget.window seconds), detaches them, and
waits until the traced processes have earned the next window's cost. The scheduler is
Windows, mixed into WindowedMalloc (top, the exporter) and WindowedHeap (heap -p: its
allocating functions' uprobes, no free probes; the profile scales the windows' samples,
sources.heapprofile.WindowedProfile). What a window costs is measured, not assumed:

  cost = runs x trap + BPF run time + attach/detach CPU
         runs, BPF run time: the kernel's BPF statistics (run_cnt, run_time_ns of the
           malloc programs, BPF_ENABLE_STATS on while a window's probes are attached);
           a source whose counters see every call (WindowedMalloc: 2 runs an allocating
           call, 1 a free) has them on in one window of STATS_EVERY only, for a part
           (STATS_PART of its length) before its measured part: the statistics slow every
           program run (2-13 % of a fully traced malloc storm's CPU time a call, 15-20 % of
           redis-server's pace, measured), so a saturated process's pace measured with
           them on would be slower than under full tracing; the rest of the window, and
           the other windows, cost their counted runs at the trap and BPF ns a counted run
           had while they were last on;
         trap: the kernel's work around each run (the breakpoint exception, the uprobe
           lookup, the emulated instruction or return trampoline), calibrated at start in
           this process (calibrate(): malloc+free pairs with and without uprobes running an
           empty program at the same places), and apart for an instruction the kernel
           single-steps (free+0 of glibc 2.36: what other allocators' entries cost); each
           program's runs at the cost of the sites it is attached to;
         attach/detach: the CPU time of the threads creating and closing the links or
           perf events (pymtrace's own, counted against the budget too).
  budget: cost so far <= PCT/100 x (the traced processes' CPU time - the traps and BPF
          runs in it); -p: each process's CPU clock (clock_getcpuclockid: nanoseconds);
          every process: the host's busy CPU time (/proc/stat) minus pymtrace's own.

Windows start at a random time (the first a random part of a second after attach, or later)
once the credit (PCT/100 x that CPU time - the cost so far) covers the next window's
predicted cost and the credit earned since the last window reaches a random fraction (0-2x,
1x on average) of it: they fall at random times, never in step with a periodic workload.
Until a window has seen
calls, windows last FIRST_WINDOW seconds and are priced as if their traps took all the CPU
time the traced processes run; then Budget.window seconds (shorter while a process is
saturated: as long as the budget affords every few seconds), priced at the last window's cost
per second (scaled by how the traced processes' CPU pace moved since) plus its fixed part
(the traps while attaching and detaching, the attach/detach CPU). A window that costs more
than predicted is paid back before the next starts: the cost stays under the budget but
for at most one window's misprediction.

Estimates: in a window every call is counted (MallocSource's exact counters), in its
measured part (every probe attached) too: each process's calls, requested bytes and sizes
per second there are its estimated pace, carried on between windows (a step in its pace is
followed at its next window). That is the pace full tracing of the same process measures:
a process with CPU time to spare (most services) absorbs the traps in more CPU time and
keeps its pace, traced or not; a saturated one (a CPU-bound loop, a server at its limit) is
slowed by the traps in a window as by full tracing, and its estimates are its pace under
the traps (the windows' programs, WINDOW_DEFINES: lighter than full tracing's for other
allocators than glibc's), a lower bound of its untraced pace: said in every view
("saturated": one of its threads never slept in the window, by the scheduler's counts,
while the traps took more than 5 % of its CPU time). Its untraced pace is not estimated:
its own work cannot be told from the traps' time where the traps are most of its CPU time
(a malloc storm: 99 %), not to the calibration's +-50 % (no instruction counter to count
its own work); its pace under the traps is pooled over its last saturated windows (up to
POOLED). Their error (95 %): the window's count (Poisson) and the spread of its last
windows' paces.

Live bytes need every free seen: not estimated (the snapshot has none; RSS is kept).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import math
import os
import random
import statistics
import threading
import time
import typing
from typing import Any, Iterable

from pymtrace.bpf import stats as bpfstats
from pymtrace.bpf import structs, uprobes
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources.base import attach_plan, lost_counts, lost_names, percpu_items, sum_percpu
from pymtrace.sources.heap import HeapSource
from pymtrace.sources.malloc import MallocSource, probe_plan
from pymtrace.sources.snapshot import DELETE_CALLS, FREE_CALLS
from pymtrace.tracee import elf, libc, probesite, proc

DEFAULT_WINDOW = 1.0
MIN_WINDOW, MAX_WINDOW = 0.01, 600.0
# How far a traced process's trap cost may be from the one calibrated in pymtrace's own
# process (a Python loop: its caches differ): 0.55-0.73 us a run in C processes measured
# against 0.8-1.1 us calibrated on a loaded 2-core machine (bench/budget_bench.py); only
# whether a process is saturated is judged with it
TRAP_UNCERTAINTY = 0.5
Z95 = 1.96
# saturated: a thread ran or waited to run this much of a window (it never slept) while the
# traps took more than SLOWED_SHARE of the process's CPU time (less: its pace within 5 %)
BUSY, SLOWED_SHARE = 0.9, 0.05
CALIBRATION_PAIRS = 20000
CALIBRATION_ROUNDS = 5
RECENT = 4  # windows whose spread is part of a process's error
# a source that counts its runs itself: the BPF statistics on in one window of this many, for
# this part of its length more, before its measured part (a process's pace: they slow every
# run; its measured part as long as any window's, whose reads at its ends slow a short one)
STATS_EVERY, STATS_PART = 4, 0.5
# a saturated process's newest saturated windows pooled into its pace (more: a step lags)
POOLED = 4
# a saturated process: windows the budget affords every this many seconds (not shorter than
# the minimum: the attach and detach around a window cost milliseconds of CPU)
SATURATED_SPACING, SATURATED_MIN_WINDOW = 5.0, 0.05
# the first window, whose cost is unknown until it ends: priced as all traps, so as long as
# a saturated process's (at 1 %, 5 s of the traced processes' CPU time earns it)
FIRST_WINDOW = SATURATED_MIN_WINDOW
MOSTLY_TRAPS = 0.5  # a source that judges no process alone: saturated when the traps took this much
PACE_NS = 1_000_000_000  # the traced processes' pace: their CPU time over about this long
MIN_PACE = 0.001  # below: idle, no pace to scale a window's cost by
# the windows' malloc programs: no live bytes, so other allocators' blocks are not kept (a
# map update at each of their calls, and a map to empty after each window); a saturated
# jemalloc process's pace under these traps is ~6 % above its pace under full tracing's
WINDOW_DEFINES = {"MS_FBLOCKS": 0}


@dataclasses.dataclass(frozen=True)
class Budget:
    """--max-overhead: at most MAX_OVERHEAD percent of the traced processes' CPU time spent
    on tracing them; the probes attached for windows of WINDOW seconds (SEED: the random
    window starts', for tests)."""

    max_overhead: float
    window: float = DEFAULT_WINDOW
    seed: int | None = None

    def check(self, option: str = "--max-overhead", window_option: str = "--window") -> None:
        if not (0 < self.max_overhead <= 100) or math.isnan(self.max_overhead):
            raise PymtraceError(f"{option} must be a percentage above 0 and at most 100")
        if not (MIN_WINDOW <= self.window <= MAX_WINDOW):
            raise PymtraceError(f"{window_option} must be between {MIN_WINDOW:g} and {MAX_WINDOW:g} seconds")


@dataclasses.dataclass(frozen=True)
class TrapCost:
    """The kernel's cost around one uprobe program run on this machine (calibrate()): at an
    emulated instruction or a return, and at a single-stepped one."""

    ns_per_run: float  # emulated entries and returns: median of the rounds
    spread_ns: float  # half the range of the rounds
    way: str  # "uprobe_multi link" or "perf-event uprobe"
    pairs: int  # malloc+free pairs per round
    single_step_ns: float = 0.0  # a single-stepped entry (0: not measured, as ns_per_run)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _run_counts(fd: int) -> tuple[int, int]:
    """(run_cnt, run_time_ns) of the BPF program FD (kernel BPF statistics)."""
    info = bpfstats.fdinfo(fd) or {}
    return int(info.get("run_cnt", 0)), int(info.get("run_time_ns", 0))


def calibrate(pairs: int = CALIBRATION_PAIRS, rounds: int = CALIBRATION_ROUNDS) -> TrapCost:
    """Measure the trap cost per run: PAIRS malloc(64)+free pairs through ctypes in this
    thread, its CPU time without probes and with uprobes on malloc (entry, return) and free
    at the places MallocSource probes (pymtrace.sources.malloc.probe_plan of this process's
    libc) running an empty program, attached the way this kernel attaches them; minus the
    program's own run time; per run; median of ROUNDS. Needs the kernel's BPF statistics on
    (run_cnt). ~0.5 s."""
    path = libc.process_libc(os.getpid())
    if path is None:
        raise PymtraceError("cannot calibrate the uprobe trap cost: this Python maps no libc")
    plan = dict(probe_plan(path))
    sites = {False: [], True: []}  # ret -> file offsets
    for function in ("malloc", "free"):
        address = elf.symbol(path, function).address
        for kind, off, _program in plan.get(function, ()):
            sites[kind != "entry"].append(elf.code_offset(path, address + off))
    # free's first instruction where the kernel single-steps it (glibc 2.36's `test`):
    # what other allocators' entries cost (docs/top.md "Overhead")
    free_at = elf.symbol(path, "free").address
    stepped = [] if probesite.emulated_at(path, free_at) else [elf.code_offset(path, free_at)]
    lib = ctypes.CDLL(path)
    malloc_, free_ = lib.malloc, lib.free
    malloc_.restype, malloc_.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free_.argtypes = [ctypes.c_void_p]

    def loop(n: int) -> int:
        began = time.thread_time_ns()
        for _ in range(n):
            free_(malloc_(64))
        return time.thread_time_ns() - began

    multi = uprobes.multi_links()
    prog = uprobes.empty_program(multi)
    try:
        loop(1000)  # warm: ctypes' call path, the allocator's tcache
        untraced = [loop(pairs) for _ in range(rounds)]
        per_run = _per_run(prog, path, sites, loop, pairs, untraced)
        few = max(pairs // 10, 100)  # ~11 us a single-stepped run: a tenth of the pairs
        single = (
            _per_run(prog, path, {False: stepped}, loop, few, [loop(few) for _ in range(rounds)]) if stepped else []
        )
    except OSError as exc:
        raise PymtraceError(f"cannot calibrate the uprobe trap cost: {exc.strerror or exc}") from None
    finally:
        os.close(prog)
    way = "uprobe_multi link" if multi else "perf-event uprobe"
    single_ns = statistics.median(single) if single else 0.0
    return TrapCost(statistics.median(per_run), (max(per_run) - min(per_run)) / 2, way, pairs, single_ns)


def _per_run(prog: int, path: str, sites: dict, loop: Any, pairs: int, untraced: list[int]) -> list[float]:
    """Per round: the CPU ns a program run at SITES ({ret: file offsets}) adds to LOOP(PAIRS),
    against the UNTRACED rounds, less the program's own run time."""
    fds = []
    try:
        for ret, offsets in sites.items():
            if offsets:
                fds += uprobes.attach_program(prog, path, offsets, os.getpid(), ret)
        out = []
        for base in untraced:
            cnt0, ns0 = _run_counts(prog)
            traced = loop(pairs)
            cnt1, ns1 = _run_counts(prog)
            if cnt1 <= cnt0:
                raise PymtraceError("cannot calibrate the uprobe trap cost: the kernel counted no program run")
            out.append(max(traced - base - (ns1 - ns0), 0) / (cnt1 - cnt0))
        return out
    finally:
        for fd in fds:
            os.close(fd)


class _CpuMeter:
    """CPU nanoseconds the traced processes ran since start: -p, the sum of each one's CPU
    clock's growth (an exited one keeps what it ran); every process, the host's busy time
    minus this process's own."""

    def __init__(self, pids: Iterable[int] | None) -> None:
        self.pids = list(pids) if pids is not None else None
        self.total = 0
        self._last = self._read()

    def _read(self) -> dict[Any, int]:
        if self.pids is None:
            busy = proc.host_busy_ns()
            return {} if busy is None else {"host": busy - time.process_time_ns()}
        return {pid: ns for pid in self.pids if (ns := proc.cpu_ns(pid)) is not None}

    def update(self) -> int:
        now = self._read()
        for key, ns in now.items():
            before = self._last.get(key)
            if before is not None and ns > before:
                self.total += ns - before
        self._last = {**self._last, **now}
        return self.total


@dataclasses.dataclass
class _Estimate:
    """One process's estimated counters (MallocSource's, as one vector: calls, requested
    bytes, size buckets), and what they grow by per second."""

    est: list[float]
    mark: int  # monotonic ns up to which est accounts for its calls
    per_s: list[float] | None = None  # from the last windows; None before the first
    error: float | None = None  # relative, 95 %
    saturated: bool = False  # in its last window: per_s is its pace under the traps
    trap_share: float | None = None  # of its CPU time in its last window, modeled
    windows: int = 0
    sampled_calls: int = 0
    sampled_ns: int = 0  # the windows' measured parts
    sampled_cpu_ns: int = 0  # its CPU time in them
    base: list[float] | None = None  # est when the current window began
    pending_ns: int = 0  # before its first window, estimated when it ends
    last_window: float | None = None
    recent: list = dataclasses.field(default_factory=list)  # its _Sample of the last windows


class _Sample(typing.NamedTuple):
    """One process in one window's measured part: its counters' growth, the part's length
    (ns), its calls counted, whether the traps slowed it (saturated), the modeled share of
    its CPU time the traps and BPF runs took (None: no CPU time read), its CPU time (ns)."""

    counts: list[float]
    ns: int
    calls: int
    saturated: bool = False
    trap_share: float | None = None
    cpu_ns: int = 0


def _rate(samples: list[_Sample]) -> tuple[list[float], float | None]:
    """(counters per second, their relative 95 % error) from SAMPLES, a process's last
    windows. A process with CPU to spare: the newest window's (one that changes pace is
    followed at its next window); the error from its calls counted (Poisson) and the spread
    of the last windows' rates (how much its pace moves between windows is what one window
    can be off by). A saturated one: its pace under the traps follows the CPU the scheduler
    gives it in each short window, so its newest run of saturated windows is pooled (calls
    over their time) and the spread's error is that of their mean."""
    last = samples[-1]
    pooled = [last]
    if last.saturated:
        for x in reversed(samples[-POOLED:-1]):
            if not x.saturated:
                break
            pooled.append(x)
    ns = sum(x.ns for x in pooled)
    per_s = [sum(col) * 1e9 / ns for col in zip(*(x.counts for x in pooled))]
    calls = sum(x.calls for x in pooled)
    if not calls:
        return per_s, None
    error = Z95**2 / calls
    rates = [x.calls / x.ns for x in (pooled if len(pooled) > 1 else samples[-RECENT:])]
    if len(rates) > 1 and statistics.fmean(rates) > 0:
        error += (Z95 * statistics.stdev(rates) / statistics.fmean(rates)) ** 2 / len(pooled)
    return per_s, math.sqrt(error)


def _growth(c0: list[int] | None, c1: list[int]) -> list[int]:
    """A process's counter vector's growth from C0 to C1 (C0 None, or above C1: a process
    new to the table, its pid's old entry deleted meanwhile: all of C1)."""
    return [b - a for a, b in zip(c0, c1)] if c0 is not None and c0[0] <= c1[0] else list(c1)


def _grown(before: dict[int, int], after: dict[int, int]) -> int:
    """The CPU ns the processes of AFTER ran since BEFORE (one not in BEFORE: all it ran)."""
    return sum(ns - before.get(pid, 0) for pid, ns in after.items())


class _Measured:
    """A window's measured part (every probe attached): counters, CPU clocks and program runs
    read at its start and end, each process's pace (CPU ns per ns) before the window, and
    the scheduler's demand of the threads of the processes known to call (DEMAND0, END's
    DEMAND1: {pid: {tid: ns run + ns waiting to run}}, each read from monotonic ns DEMAND_AT
    on: its own span, not the part's, which the reads before it would stretch or shrink)."""

    def __init__(
        self,
        counts0: dict,
        cpu0: dict,
        runs0: tuple[int, int, float],
        t0: int,
        pace: dict,
        demand0: dict | None = None,
        demand_at: int | None = None,
    ) -> None:
        self.counts0, self.cpu0, self._runs0, self._t0, self.pace = counts0, cpu0, runs0, t0, pace
        self.demand0 = demand0 or {}
        self.demand1 = {}
        self._demand_at0, self._demand_at1 = demand_at, None

    def end(
        self,
        counts1: dict,
        cpu1: dict,
        runs1: tuple[int, int, float],
        t1: int,
        demand1: dict | None = None,
        demand_at: int | None = None,
    ) -> None:
        self.counts1, self.cpu1 = counts1, cpu1
        self.runs, self.bpf_ns = runs1[0] - self._runs0[0], runs1[1] - self._runs0[1]
        self.trap_ns = runs1[2] - self._runs0[2]
        self.seconds = (t1 - self._t0) / 1e9
        self.demand1 = demand1 or {}
        self._demand_at1 = demand_at

    def busiest(self, pid: int) -> float | None:
        """The largest share of the time between the two demand reads one of PID's threads
        ran or waited to run (1: it never slept), None where its threads were not read."""
        before, after = self.demand0.get(pid), self.demand1.get(pid)
        a, b = self._demand_at0, self._demand_at1
        span = b - a if a is not None and b is not None else self.seconds * 1e9
        if not before or not after or span <= 0:
            return None
        grown = [after[tid] - before[tid] for tid in after.keys() & before.keys()]
        return max(grown) / span if grown else None


def clear_in_flight(bpf: Any, tables: Iterable[bytes], active: bytes) -> None:
    """Empty BPF's maps TABLES (calls in flight; one this module was compiled without is
    skipped) and zero its counter ACTIVE (an array's entry 0): detached mid-call, a thread's
    state would make the next window skip its calls as nested ones."""
    for name in tables:
        try:
            bpf[name].clear()
        except KeyError:
            continue
    try:
        counter = bpf[active]
        counter[counter.Key(0)] = counter.Leaf(0)
    except KeyError:
        pass


class MeasuredParts:
    """The windows' measured parts (every probe attached): [start, end] in monotonic ns, the
    clock the kernel stamps samples with. Each end is read and recorded under a lock, and a
    sample is read after it was taken, so part_of() places it right while its part is open
    too. START_NS: when the windows began to be scheduled (the run a profile estimates).
    KEEP false: the clock read only, nothing kept (a source that runs for months needs none)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int | None] = []
        self.start_ns = time.monotonic_ns()

    def begin(self) -> int:
        with self._lock:
            now = time.monotonic_ns()
            if self.keep:
                self._starts.append(now)
                self._ends.append(None)
            return now

    def end(self) -> int:
        with self._lock:
            now = time.monotonic_ns()
            if self.keep:
                self._ends[-1] = now
            return now

    def part_of(self, ts_ns: int) -> int | None:
        """The index of the part TS_NS fell in, None if in none."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ts_ns) - 1
            if i < 0:
                return None
            end = self._ends[i]
            return i if end is None or ts_ns <= end else None

    def parts(self, now_ns: int) -> list[tuple[int, int]]:
        """Every part as (start, end), one still open ending at NOW_NS."""
        with self._lock:
            return [(a, now_ns if b is None else b) for a, b in zip(self._starts, self._ends)]


class Windows:
    """The window scheduler (module docstring) of a Source: when a window opens, what it costs,
    the credit, the random starts, its uprobes attached and released (their handles in
    _handles). Mixed in before the source's class; the source gives _plan_tables() (its
    {path: probe plan} tables: each program's trap cost), _window_attachments() (the attach
    calls of a window) and may hook _windows_ready, _window_opens, _read_counts, _callers,
    _detached and _window_closes (WindowedMalloc's estimates)."""

    bpf: Any
    pids: Any
    keeps_parts = False  # whether `parts` keeps every window's measured part (a profile's scaling)
    counts_runs = False  # whether _counted_runs() gives a window's program runs (STATS_EVERY)

    def _init_windows(self, budget: Budget) -> None:
        budget.check()
        self.budget = budget
        self.trap: TrapCost | None = None
        self._rng = random.Random(budget.seed)
        self._bpfstats = None
        self._handles = []
        self._prog_fds = []
        self._thread = None
        self._stop = threading.Event()
        self._state = threading.Lock()
        self._meter = None
        self.parts = MeasuredParts(self.keeps_parts)
        self.in_window = False
        self.windows = 0
        self.window_ns = 0  # wall time with probes attached (attach start to detach end)
        self.trap_ns = 0  # runs x calibrated trap cost
        self.bpf_ns = 0  # BPF run time
        self.switch_ns = 0  # attach/detach CPU
        self.stats_windows = 0  # windows with the BPF statistics on
        self._per_counted = None  # (trap ns, BPF ns) a counted run, in the last of them
        self.errors = []  # attach failures during windows (the first few)
        self._rate = None  # (trap + BPF) ns per ns of the last window's measured part
        self._then = (0.0, 0.0)  # the traced CPU pace before it, and in its measured part
        self._paces = []  # (monotonic ns, traced CPU ns): the last second's readings
        self._switch = None  # the rest of its cost: traps while attaching/detaching, that CPU
        self._earned_at = 0.0  # useful CPU ns when the last window ended
        self._threshold = 0.0  # credit to earn before the next window (random)

    # -- what a source gives
    def _plan_tables(self) -> Iterable[dict[str, list]]:
        raise NotImplementedError

    def _window_attachments(self) -> Iterable[tuple[Any, tuple]]:
        """(attach function, its arguments) of each attach a window makes."""
        raise NotImplementedError

    def _windows_ready(self) -> None:
        """Window 0 is over, the first reading taken: the source's own start."""

    def _window_opens(self, now_ns: int) -> None:
        """A window opens at NOW_NS (under the state lock)."""

    def _read_counts(self) -> dict[int, list[int]]:
        return {}

    def _callers(self, candidates: list[int]) -> list[int]:
        """The processes whose threads' scheduler demand a window reads."""
        return []

    def _counted_runs(self, before: dict[int, list[int]], after: dict[int, list[int]]) -> int:
        """The program runs the counters read (_read_counts) BEFORE and AFTER tell (counts_runs)."""
        raise NotImplementedError

    def _detached(self) -> None:
        """A window's probes are released: the BPF side's state of calls in flight goes."""

    def _window_closes(self, m: _Measured, counts: dict[int, list[int]], start_ns: int, now_ns: int) -> int:
        """The window that began at START_NS ended at NOW_NS (under the state lock); its
        measured part M, COUNTS read after it. Returns the traced processes' CPU ns in M."""
        return _grown(m.cpu0, m.cpu1)

    # -- attach: window 0, calibration, the thread
    def _attach(self) -> None:
        self._bpfstats = bpfstats.BpfStats()
        if not self._bpfstats.enable():
            raise PymtraceError(
                "--max-overhead measures the BPF programs' run time with the kernel's BPF statistics, "
                "which could not be turned on (BPF_ENABLE_STATS, kernel.bpf_stats_enabled)"
            )
        # window 0: every probe attached once and detached at once, so that a file or process
        # that cannot be probed fails here, as without a budget, and the switch is measured
        super()._attach()
        # its attach loaded the programs (the verifier's work, once): a start-up cost, as the
        # compile is, not the budget's; twice its detach is the first guess of a window's
        self._switch = 2e9 * uprobes.release(self.bpf, self._handles)
        self._handles = []
        self.trap = calibrate()
        # the statistics cost every BPF program on the machine a clock read or two a run:
        # on only while a window's probes are attached (they count nothing between windows)
        self._bpfstats.close()
        funcs = self.bpf.funcs
        self._prog_fds = [
            (funcs[n.encode()].fd, ns) for n, ns in sorted(self._run_costs().items()) if n.encode() in funcs
        ]
        self._meter = _CpuMeter(self.pids)
        self._useful_ns()  # the first reading of the traced processes' pace
        self._start_ns = self.parts.start_ns = time.monotonic_ns()
        self._last_cpu = (self._start_ns, self._cpu(self._candidates()))
        self._windows_ready()
        self._thread = threading.Thread(target=self._loop, name="pymtrace-budget", daemon=True)
        self._thread.start()

    def _run_costs(self) -> dict[str, float]:
        """{program: trap ns a run}: the single-stepped cost for a program whose main entry
        site in some function the kernel single-steps (probesite.emulated_at), else the
        emulated one (a side path, free(NULL)'s early exit, is rarely taken)."""
        costs = {}
        stepped_ns = max(self.trap.single_step_ns, self.trap.ns_per_run)
        for plans in self._plan_tables():
            for path, plan in plans.items():
                for function, probes in plan:
                    address = elf.symbol(path, function).address
                    main = next((off for kind, off, _ in probes if kind == "entry"), None)
                    for kind, off, program in probes:
                        stepped = off == main and kind == "entry" and not probesite.emulated_at(path, address + off)
                        costs[program] = max(costs.get(program, 0.0), stepped_ns if stepped else self.trap.ns_per_run)
        return costs

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._handles and self.bpf is not None:
            uprobes.release(self.bpf, self._handles)
            self._handles = []
        if self._bpfstats is not None:
            self._bpfstats.close()
            self._bpfstats = None
        super().close()

    # -- reading
    def _runs(self) -> tuple[int, int, float]:
        """(runs, BPF run ns, their traps' ns) of the source's programs attached to uprobes,
        since load (the BPF statistics)."""
        cnt = ns = 0
        trap = 0.0
        for fd, per_run in self._prog_fds:
            c, n = _run_counts(fd)
            cnt, ns, trap = cnt + c, ns + n, trap + c * per_run
        return cnt, ns, trap

    def _counted(self, before: dict[int, list[int]], after: dict[int, list[int]]) -> tuple[int, int, float]:
        """_runs() where the BPF statistics are off: the runs the counters read BEFORE and
        AFTER tell, at the trap and BPF ns a counted run of the last window with the
        statistics on."""
        n = self._counted_runs(before, after)
        trap, bpf = self._per_counted
        return n, int(n * bpf), n * trap

    @staticmethod
    def _demand(pids: Iterable[int]) -> dict[int, dict[int, int]]:
        return {pid: d for pid in pids if (d := proc.thread_demand_ns(pid)) is not None}

    def _cpu(self, pids: Iterable[int]) -> dict[int, int]:
        return {pid: ns for pid in pids if (ns := proc.cpu_ns(pid)) is not None}

    def _candidates(self) -> list[int]:
        """The processes a window may count: -p, those watched; else every process."""
        return list(self.pids) if self.pids is not None else libc.pids()

    # -- the budget
    def _useful_ns(self) -> int:
        """The traced processes' CPU ns since start on their own work (their CPU time minus
        the traps and BPF runs in it)."""
        total = self._meter.update()
        now = time.monotonic_ns()
        self._paces.append((now, total))
        while len(self._paces) > 2 and now - self._paces[1][0] >= PACE_NS:
            self._paces.pop(0)
        return total - self.trap_ns - self.bpf_ns

    def _pace(self) -> float:
        """The traced processes' CPU ns per ns over the last second or so (the meter's growth)."""
        if len(self._paces) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self._paces[0], self._paces[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    def _credit(self, useful: int) -> float:
        return self.budget.max_overhead / 100 * useful - (self.trap_ns + self.bpf_ns + self.switch_ns)

    def _predicted(self, length: float) -> float:
        """The cost (ns) of a window of LENGTH seconds, as the last window cost per second of
        its measured part (scaled by how the traced processes' CPU pace moved since), plus
        its fixed cost (the traps while its probes are attached and detached, and that CPU);
        until a window has seen calls, a short one's, its traps taking as much CPU time as
        the traced processes run."""
        length *= 1 + self._stats_part()
        if self._rate is None:  # as many traps as the CPU they run (a short window)
            return max(self._pace(), self._then[1]) * length * 1e9 + self._switch
        # as busy as then, it costs as much; busier, more: as the traced processes' CPU pace
        # moved since, never above the CPU they run (their pace, or theirs in that window)
        pace, (then, window_cpu) = self._pace(), self._then
        cap = max(pace, window_cpu)
        rate = cap if then < MIN_PACE else min(self._rate * pace / then, cap)
        return rate * length * 1e9 + self._switch

    def _next_length(self) -> float:
        """FIRST_WINDOW until a window has seen calls (their cost unknown), then the budget's;
        shorter while a traced process is saturated (or the traps took most of the CPU time
        the traced processes ran): a window then costs it about its whole length, and one
        long window every few minutes would make its estimate one short look at the CPU the
        scheduler gave it. So the longest window the budget affords every SATURATED_SPACING
        seconds at the traced processes' CPU pace, at least SATURATED_MIN_WINDOW."""
        if self._rate is None:
            return min(self.budget.window, FIRST_WINDOW)
        if not self._any_saturated() or self._rate <= 0:
            return self.budget.window
        earned = self.budget.max_overhead / 100 * max(self._pace(), self._then[1]) * SATURATED_SPACING * 1e9
        affordable = (earned - self._switch) / (self._rate * 1e9)
        return min(self.budget.window, max(affordable, SATURATED_MIN_WINDOW))

    def _stats_part(self) -> float:
        """The part of its length the next window adds before its measured part with the BPF
        statistics on, to price a counted run (a source that counts its runs: until one is
        priced, then in one window of STATS_EVERY); 0 without."""
        pricing = self.counts_runs and (self._per_counted is None or self.windows % STATS_EVERY == 0)
        return STATS_PART if pricing else 0.0

    def _any_saturated(self) -> bool:
        """Whether the traced processes were slowed by the traps in the last window: when
        the traps and BPF runs took most of the CPU time they ran in its measured part (a
        source that judges each process adds its judgements)."""
        return self._rate is not None and self._rate > MOSTLY_TRAPS * self._then[1] > 0

    def _loop(self) -> None:
        try:
            self._windows()
        except Exception as exc:  # a bug or a map that cannot be read: said in every view, no more windows
            self.errors.append(f"the windows stopped: {type(exc).__name__}: {exc}")
            if self._handles and self.bpf is not None:
                uprobes.release(self.bpf, self._handles)
                self._handles = []
            self._bpfstats.close()  # (on if it stopped in a window)

    def _windows(self) -> None:
        poll = min(0.25, self.budget.window / 2)
        if self._stop.wait(self._rng.uniform(0, min(1.0, self.budget.window))):
            return
        while not self._stop.wait(poll):
            length = self._next_length()
            predicted = self._predicted(length)
            with self._state:
                useful = self._useful_ns()
                earned = self.budget.max_overhead / 100 * (useful - self._earned_at)
                if self._credit(useful) < predicted or earned < self._threshold:
                    continue
            self._window(length)
            with self._state:
                self._earned_at = self._useful_ns()
                self._threshold = self._rng.uniform(0, 2) * self._predicted(self._next_length())

    # -- one window
    def _attach_all(self) -> None:
        for attach, args in self._window_attachments():
            try:
                attach(*args)
            except ProcessGone:
                continue  # reported exited by the snapshots
            except PymtraceError as exc:
                if len(self.errors) < 5:
                    self.errors.append(str(exc))

    def _window(self, length: float) -> None:
        t0 = time.monotonic_ns()
        candidates = self._candidates()
        start_cpu = self._cpu(candidates)
        with self._state:
            self._window_opens(t0)
            self.in_window = True
        # each process's pace before the window: CPU ns per ns since the last window ended
        t_before, cpu_before = self._last_cpu
        pace = {
            pid: (ns - cpu_before[pid]) / (t0 - t_before)
            for pid, ns in start_cpu.items()
            if pid in cpu_before and t0 > t_before
        }
        with self._state:
            self._useful_ns()
            pace_before = self._pace()
        pricing = self._stats_part()
        stats = not self.counts_runs or pricing > 0
        if stats and not self._bpfstats.enable():
            raise PymtraceError("the kernel's BPF statistics could not be turned on again (BPF_ENABLE_STATS)")
        # the window's runs so far: the statistics' count while they are on (ON), then the
        # runs its counters tell since they went off (OFF_AT) on top of the statistics' last
        on, off_at, on_runs = stats, {} if stats else self._read_counts(), (0, 0, 0.0)

        def runs(counts: dict[int, list[int]]) -> tuple[int, int, float]:
            if on:
                return self._runs()
            n, bpf, trap = self._counted(off_at, counts)
            return on_runs[0] + n, on_runs[1] + bpf, on_runs[2] + trap

        runs0 = runs(off_at)
        began = time.thread_time_ns()
        self._attach_all()
        attach_ns = time.thread_time_ns() - began
        if pricing:
            # a source that counts its runs: the statistics on for a part before the measured
            # one only, to price a counted run; they slow every run, so a saturated process's
            # pace is measured after they go off, as full tracing runs
            counts_a, runs_a = self._read_counts(), self._runs()
            self._stop.wait(length * pricing)
            counts_b, runs_b = self._read_counts(), self._runs()
            counted = self._counted_runs(counts_a, counts_b)
            if counted:
                self._per_counted = ((runs_b[2] - runs_a[2]) / counted, (runs_b[1] - runs_a[1]) / counted)
            if self._per_counted is not None:
                self._bpfstats.close()
                on, off_at, on_runs = False, counts_b, runs_b
        # the measured part: every probe attached (calls and CPU read at both ends)
        callers = self._callers(candidates)
        # each end's time taken just before its counts: reading every process's CPU clock
        # and threads after them takes long where processes are many (a VM's emulation: a
        # tenth of a 0.5 s window), and would stretch one end's time and not the other's
        begun = self.parts.begin()
        counts0 = self._read_counts()
        cpu0, runs0_in = self._cpu(candidates), runs(counts0)
        demand_at = time.monotonic_ns()
        m = _Measured(counts0, cpu0, runs0_in, begun, pace, self._demand(callers), demand_at)
        self._stop.wait(length)
        ended = self.parts.end()
        counts1 = self._read_counts()
        cpu1, runs1_in = self._cpu(m.cpu0), runs(counts1)
        demand_at = time.monotonic_ns()
        m.end(counts1, cpu1, runs1_in, ended, self._demand(callers), demand_at)
        detach_ns = uprobes.release(self.bpf, self._handles) * 1e9
        self._handles = []
        self._detached()
        counts = self._read_counts()
        runs1 = runs(counts)
        if on:
            self._bpfstats.close()
        end_cpu = self._cpu(candidates)
        t1 = time.monotonic_ns()
        self._last_cpu = (t1, end_cpu)
        with self._state:
            bpf_ns, trap_ns = runs1[1] - runs0[1], runs1[2] - runs0[2]
            # traps and BPF runs are CPU time of the processes that trap: never more than
            # they ran (the trap cost is calibrated in pymtrace's own process, whose caches
            # differ: a CPU-bound process's modeled traps came to 2.5x its CPU time)
            trap_ns = min(trap_ns, max(_grown(start_cpu, end_cpu) - bpf_ns, 0))
            m.trap_ns = min(m.trap_ns, max(_grown(m.cpu0, m.cpu1) - m.bpf_ns, 0))
            if m.runs:
                # the runs while attaching and detaching at most at a run's cost in the
                # measured part: capped there, it bounds the model (a saturated process's
                # CPU time during a detach's ~0.1 s is mostly its own: the breakpoints go first)
                trap_ns = min(trap_ns, m.trap_ns * (runs1[0] - runs0[0]) / m.runs)
            self.windows += 1
            self.stats_windows += stats
            self.window_ns += t1 - t0
            self.trap_ns += int(trap_ns)
            self.bpf_ns += bpf_ns
            self.switch_ns += int(attach_ns + detach_ns)
            # the measured part's cost per ns, and the rest (traps while attaching and
            # detaching, the switch's CPU) as a window's fixed cost
            inside = m.trap_ns + m.bpf_ns
            fixed = trap_ns + bpf_ns - inside + attach_ns + detach_ns
            # the last window's: a workload's cost moves with it (unknown while none calls)
            self._rate = inside / max(m.seconds * 1e9, 1) if m.runs else self._rate
            self._switch = fixed
            cpu_in_window = self._window_closes(m, counts, t0, t1)
            self._then = (pace_before, cpu_in_window / max(m.seconds * 1e9, 1))
            self.in_window = False

    def summary(self) -> dict[str, Any]:
        """snapshot["budget"]: the budget, what the windows cost, how the cost is measured."""
        now = time.monotonic_ns()
        useful = self._useful_ns()
        extra = self.trap_ns + self.bpf_ns + self.switch_ns
        elapsed = max(now - self._start_ns, 1)
        return {
            "max_overhead_pct": self.budget.max_overhead,
            "window_seconds": self.budget.window,
            "windows": self.windows,
            "bpf_stats_windows": self.stats_windows,
            "attached": self.in_window,
            "duty_cycle": min(self.window_ns / elapsed, 1.0),
            "overhead_pct": 100 * extra / useful if useful > 0 else None,
            "traced_cpu_seconds": useful / 1e9,
            "cost_seconds": {
                "traps": self.trap_ns / 1e9,
                "bpf": self.bpf_ns / 1e9,
                "attach_detach": self.switch_ns / 1e9,
            },
            "trap_ns_per_run": self.trap.ns_per_run,
            "trap_spread_ns": self.trap.spread_ns,
            "trap_single_step_ns": self.trap.single_step_ns,
            "probes": self.trap.way,
            "errors": list(self.errors),
        }


class WindowedMalloc(Windows, MallocSource):
    """MallocSource under a Budget: the same programs and counters, the uprobes attached in
    windows (module docstring); snapshot() gives estimated counters (no live bytes)."""

    counts_runs = True

    def __init__(
        self,
        pids: Iterable[int | str] | None,
        budget: Budget,
        track_exits: bool = True,
        max_procs: int = 8192,
    ) -> None:
        super().__init__(pids, track_exits, max_procs)
        self._init_windows(budget)
        self._est: dict[int, _Estimate] = {}
        self._seen: dict[int, list[int]] = {}  # pid -> ms_stats totals at the last read
        consts = structs.header(self.program).consts
        self._n_calls, self._n_sizes = consts["MS_NCALLS"], consts["MS_LOG2_BUCKETS"]
        self._alloc_idx, self._free_idx = self._weights()
        self._free_null = next((i for i, name in self.call_names.items() if name == "free_null"), None)

    def _weights(self) -> tuple[list[int], list[int]]:
        """Indexes of the allocating calls (entry + return probe: 2 runs) and of the frees
        (1 run; free_null is inside free's count) in the counter vector."""
        frees = [i for i, name in self.call_names.items() if name in ("free",) + tuple(DELETE_CALLS)]
        allocs = [i for i, name in self.call_names.items() if name not in FREE_CALLS]
        return allocs, frees

    def _attach_libc(self, path: str, pid: int, plan: list) -> None:
        self.attached += attach_plan(self.bpf, path, pid, plan, handles=self._handles)

    def _runs_of(self, d: list[int]) -> int:
        """The program runs counter growth D tells: 2 an allocating call, 1 a free."""
        return 2 * sum(d[i] for i in self._alloc_idx) + sum(d[i] for i in self._free_idx)

    def _counted_runs(self, before: dict[int, list[int]], after: dict[int, list[int]]) -> int:
        return sum(self._runs_of(_growth(before.get(pid), c1)) for pid, c1 in after.items())

    def _defines(self) -> dict[str, int]:
        return {**super()._defines(), **WINDOW_DEFINES}

    def _plan_tables(self) -> Iterable[dict[str, list]]:
        return (self.plans, self.cxx_plans)

    def _window_attachments(self) -> Iterable[tuple[Any, tuple]]:
        for _, path, pid, plan in self._sites():
            yield self._attach_libc, (path, pid, plan)

    def _windows_ready(self) -> None:
        self._seen = self._read_counts()
        for pid in self.pids or ():
            self._est[pid] = _Estimate([0.0] * self._width(), self._start_ns)

    def _width(self) -> int:
        return self._n_calls + 1 + self._n_sizes

    # -- reading
    def _read_counts(self) -> dict[int, list[int]]:
        """{pid: counter vector} of every process in ms_stats (calls, requested bytes, sizes)."""
        out = {}
        for key, values in percpu_items(self.bpf[b"ms_stats"]):
            s = sum_percpu(values, self.fields)
            out[int(key.value)] = [*s["calls"], s["requested_bytes"], *s["size_log2"]]
        return out

    def _any_saturated(self) -> bool:
        # or the traps took most of the CPU time: a process that slept a little in a short
        # window is not judged saturated, and a window of --window's length would cost it
        # most of that length (at 1 %, the next minute or two without a window)
        return any(e.saturated for e in list(self._est.values())) or super()._any_saturated()

    def _callers(self, candidates: list[int]) -> list[int]:
        return [pid for pid in candidates if pid in self._est]

    # -- one window
    def _window_opens(self, now_ns: int) -> None:
        self._begin(now_ns)

    def _window_closes(self, m: _Measured, counts: dict[int, list[int]], start_ns: int, now_ns: int) -> int:
        samples = self._samples(m)
        self._end(counts, samples, start_ns, now_ns)
        return sum(m.cpu1[pid] - m.cpu0[pid] for pid in samples if pid in m.cpu0 and pid in m.cpu1)

    def _detached(self) -> None:
        """Detached mid-call, a thread's outer-call state (ms_outer, ms_active, ms_ret) would
        make the next window skip its calls as nested ones: the BPF side's state goes with
        the probes."""
        clear_in_flight(self.bpf, (b"ms_outer", b"ms_ret"), b"ms_active")

    def _samples(self, m: _Measured) -> dict[int, _Sample]:
        """Per process, its _Sample of the window's measured part M: its counters' growth as
        counted, and whether it is saturated. A process with CPU to spare absorbs the traps
        in more CPU time and keeps its pace; one that does not (a CPU-bound loop, a server at
        its limit) is slowed: one of its threads never slept in the window (ran or waited to
        run BUSY of it: the scheduler's counts) while the traps and BPF runs took more than
        SLOWED_SHARE of its CPU time (the calibrated model). A process whose threads were not
        read before the window (first seen in it): its CPU time did not rise by its share of
        the traps (+-TRAP_UNCERTAINTY of them), or its own work in the window (its CPU time
        minus that share) fell short of what it ran at its pace before the window by more
        than that uncertainty. Its counts are kept as counted: its pace under the traps,
        what full tracing would count (module docstring)."""
        deltas, weights = {}, {}
        for pid, c1 in m.counts1.items():
            d = _growth(m.counts0.get(pid), c1)
            deltas[pid] = d
            weights[pid] = self._runs_of(d)
        for pid in self._est:  # a known process that made no call: 0 a second, not unknown
            if pid not in deltas and pid in m.cpu1:
                deltas[pid], weights[pid] = [0] * self._width(), 0
        total = sum(weights.values()) or 1
        ns = max(int(m.seconds * 1e9), 1)
        out = {}
        for pid, d in deltas.items():
            share = weights[pid] / total
            trap = share * m.trap_ns
            cost = trap + share * m.bpf_ns  # the BPF run time is the kernel's count: exact
            saturated, trap_share, cpu = False, None, 0
            if pid in m.cpu0 and pid in m.cpu1:
                cpu = m.cpu1[pid] - m.cpu0[pid]
                trap_share = min(cost / cpu, 1.0) if cpu > 0 else None
                busiest = m.busiest(pid)
                if busiest is not None:  # the scheduler's counts: no model
                    saturated = busiest >= BUSY and (trap_share or 0) > SLOWED_SHARE
                elif pid in m.pace and cost > 0:  # a process first seen in this window
                    own = cpu - cost
                    paced = m.pace[pid] * ns
                    uncertain = trap * TRAP_UNCERTAINTY + share * m.runs * self.trap.spread_ns
                    saturated = paced > own and (own < paced - uncertain or cpu - paced < cost - uncertain)
            calls = sum(d[: self._n_calls]) - (d[self._free_null] if self._free_null is not None else 0)
            out[pid] = _Sample(d, ns, calls, saturated, trap_share, cpu)
        return out

    def _begin(self, now_ns: int) -> None:
        """A window begins: every estimate brought up to NOW_NS, its value kept as the base."""
        for e in self._est.values():
            self._grow(e, now_ns)
            e.base = list(e.est)

    @staticmethod
    def _grow(e: _Estimate, now_ns: int) -> None:
        """E's counters grown to NOW_NS at its pace; in a window, from its base (the
        window's end sets them, its mark stays at its start)."""
        d = now_ns - e.mark
        if d <= 0:
            return
        if e.per_s is None:
            if e.base is None:
                e.pending_ns += d
                e.mark = now_ns
        elif e.base is not None:
            grown = [b + k * d / 1e9 for b, k in zip(e.base, e.per_s)]
            e.est = [max(a, b) for a, b in zip(e.est, grown)]
        else:
            e.est = [v + k * d / 1e9 for v, k in zip(e.est, e.per_s)]
            e.mark = now_ns

    @staticmethod
    def _learn(e: _Estimate, sample: _Sample, now_ns: int) -> None:
        """E's pace from its last windows, SAMPLE the newest; before its first window, what
        it did since it was first known, at the pace found now, goes into its base."""
        e.recent = (e.recent + [sample])[-max(RECENT, POOLED) :]
        first = e.per_s is None
        e.per_s, e.error = _rate(e.recent)
        if first and e.pending_ns:
            e.base = [b + x * e.pending_ns / 1e9 for b, x in zip(e.base, e.per_s)]
        e.pending_ns = 0
        e.saturated, e.trap_share = sample.saturated, sample.trap_share
        e.windows += 1
        e.sampled_calls += sample.calls
        e.sampled_ns += sample.ns
        e.sampled_cpu_ns += sample.cpu_ns
        e.last_window = now_ns / 1e9

    def _end(self, counts: dict[int, list[int]], samples: dict[int, _Sample], start_ns: int, now_ns: int) -> None:
        """A window that began at START_NS ended at NOW_NS: each process's counters grow over
        it at the pace found (the probes count only part of the window: they are attached and
        detached within it), never below what the snapshots showed."""
        width = self._width()
        for pid, sample in samples.items():
            e = self._est.get(pid)
            if e is None:
                if not sample.calls:
                    continue
                e = self._est[pid] = _Estimate([0.0] * width, start_ns, base=[0.0] * width)
            self._learn(e, sample, now_ns)
        for e in self._est.values():
            if e.base is not None and e.per_s is not None:
                grown = [b + k * (now_ns - e.mark) / 1e9 for b, k in zip(e.base, e.per_s)]
                e.est = [max(a, b) for a, b in zip(e.est, grown)]
            e.base = None
            e.mark = now_ns
        self._seen = counts

    # -- snapshots
    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        procs = {}
        with self._state:
            now_ns = time.monotonic_ns()
            for e in self._est.values():
                self._grow(e, now_ns)
            gone = self._take_exited(self._est)
            for pid, e in self._est.items():
                procs[pid] = self._entry(pid, e, pid in gone, now)
            for pid in gone:
                self._est.pop(pid, None)
                self._seen.pop(pid, None)
            budget = self.summary()
        table = self.bpf[b"ms_stats"]
        for pid in gone:
            self._delete(table, table.Key(pid))
            self.comms.forget(pid)
        lost = lost_counts(
            self.bpf[b"ms_lost"], {i: "malloc_" + n for i, n in lost_names("malloc_stats", "MS").items()}
        )
        maps = {"ms_stats": {"entries": len(self._seen), "max_entries": self.max_procs}}
        return {"time": now, "start": self.start, "processes": procs, "lost": lost, "maps": maps, "budget": budget}

    def _entry(self, pid: int, e: _Estimate, exited: bool, now: float) -> dict[str, Any]:
        p = {
            "pid": pid,
            "comm": self.comms.get(pid),
            "exited": exited,
            "estimate": {
                "windows": e.windows,
                "error": e.error,
                "sampled_calls": e.sampled_calls,
                "sampled_seconds": e.sampled_ns / 1e9,
                "sampled_cpu_seconds": e.sampled_cpu_ns / 1e9,
                "last_window_age": now - e.last_window if e.last_window is not None else None,
                "calls_per_second": sum(e.per_s[: self._n_calls]) if e.per_s is not None else None,
                # slowed by the traps in its last window: its rates are its pace under them
                "saturated": e.saturated,
                "trap_share": e.trap_share,
            },
        }
        if e.per_s is not None:
            n = self._n_calls
            p["calls"] = {name: int(e.est[i]) for i, name in self.call_names.items()}
            p["requested_bytes"] = int(e.est[n])
            p["size_log2"] = [int(x) for x in e.est[n + 1 :]]
            p["estimated"] = True
        mem = None if exited else proc.rss(pid)
        if mem is not None:
            p["rss_bytes"], p["rss_anon_bytes"] = mem
            p["rss_anon_base_bytes"] = self.rss_anon_base.get(pid, 0)
        return p


class WindowedHeap(Windows, HeapSource):
    """HeapSource under a Budget: the allocating functions' uprobes attached in windows and no
    free probes (in-use blocks need every free: not measured); `parts` says when every probe
    was attached, for the profile's scaling (sources.heapprofile.WindowedProfile). OPTIONS:
    HeapSource's."""

    keeps_parts = True

    def __init__(self, pids: Iterable[int], budget: Budget, **options: Any) -> None:
        super().__init__(pids, frees=False, **options)
        self._init_windows(budget)

    def _plan_tables(self) -> Iterable[dict[str, list]]:
        return (self.plans,)

    def _window_attachments(self) -> Iterable[tuple[Any, tuple]]:
        for kinds in (("return",), ("entry",)):  # returns first: an entry without its return stays pending
            for table in (self.libcs, self.py_allocators):
                for path, pids in list(table.items()):
                    for pid in pids:
                        yield self._attach_libc, (path, pid, kinds)

    def _attach_file(self, path: str, pid: int) -> None:
        if self._thread is None:  # window 0; later, the next window attaches it (py_allocators lists it)
            super()._attach_file(path, pid)

    def _detached(self) -> None:
        clear_in_flight(self.bpf, (b"hp_pending",), b"hp_active")

    def _windows_ready(self) -> None:
        self._detached()
