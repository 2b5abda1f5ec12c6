"""The overhead budget (--max-overhead PCT): malloc's per-call uprobes attached in windows.

A uprobe costs its trap on every call whatever its program does, so the only way to make
tracing cheaper is to have no probe there: WindowedMalloc compiles MallocSource's programs
once and attaches its uprobes for a window (Budget.window seconds), detaches them, and
waits until the traced processes have earned the next window's cost. What a window costs
is measured, not assumed:

  cost = runs x trap + BPF run time + attach/detach CPU
         runs, BPF run time: the kernel's BPF statistics (run_cnt, run_time_ns of the
           malloc programs, BPF_ENABLE_STATS held on while the source runs);
         trap: the kernel's work around each run (the breakpoint exception, the uprobe
           lookup, the emulated instruction or return trampoline), calibrated at start in
           this process (calibrate(): malloc+free pairs with and without uprobes running an
           empty program at the same places);
         attach/detach: the CPU time of the threads creating and closing the links or
           perf events (pymtrace's own, counted against the budget too).
  budget: cost so far <= PCT/100 x (the traced processes' CPU time - the traps and BPF
          runs in it); -p: each process's CPU clock (clock_getcpuclockid: nanoseconds);
          every process: the host's busy CPU time (/proc/stat) minus pymtrace's own.

The first window (FIRST_WINDOW seconds) starts at a random time within a second of attach,
before any cost is known (its cost is the budget's only overdraft: at most its length in CPU
time per traced thread). Every later one starts when the credit covers its predicted cost
(the recent windows' cost per second of window, plus their attach/detach CPU) and the credit
earned since the last window reaches a random fraction (0-2x, 1x on average) of it: windows
fall at random times, never in step with a periodic workload, and use the budget in full on
average.

Estimates: in a window every call is counted (MallocSource's exact counters). For each
process the counters of the window's fully-attached part are divided by the CPU time the
process spent on its own work meanwhile (its CPU clock minus its share of the traps and BPF
runs, shared by probe runs: 2 per allocating call, 1 per free): calls, requested bytes and
sizes per CPU-second. Outside windows each process's estimates grow by those ratios times its
CPU time (in a window: by what the window counts). So a process that gets busier between
windows is followed at once; one that changes what it does per CPU-second, at its next
window. The error (95 %) of a process's estimate: the count's Poisson error in the window
and the trap cost's uncertainty (TRAP_UNCERTAINTY of its part) over its own work; where
the traps are most of a window's CPU (a malloc storm), it is wide and said so.

Live bytes need every free seen: not estimated (the snapshot has none; RSS is kept).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import random
import statistics
import threading
import time
from typing import Any, Iterable

from pymtrace.bpf import stats as bpfstats
from pymtrace.bpf import structs, uprobes
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources.base import attach_plan, lost_counts, lost_names, percpu_items, sum_percpu
from pymtrace.sources.malloc import MallocSource, probe_plan
from pymtrace.sources.snapshot import DELETE_CALLS, FREE_CALLS
from pymtrace.tracee import elf, libc, proc

DEFAULT_WINDOW = 1.0
FIRST_WINDOW = 0.02  # seconds: the first window, whose cost is unknown until it ends
MIN_WINDOW, MAX_WINDOW = 0.01, 600.0
# How far a traced process's trap cost may be from the one calibrated in pymtrace's own
# process (a Python loop: its caches differ): 0.55-0.73 us a run in C processes measured
# against 0.8-1.1 us calibrated on a loaded 2-core machine (bench/budget_bench.py)
TRAP_UNCERTAINTY = 0.5
Z95 = 1.96
CALIBRATION_PAIRS = 20000
CALIBRATION_ROUNDS = 3
RECENT = 8  # windows whose spread widens a process's error


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
    """The kernel's cost around one uprobe program run on this machine (calibrate())."""

    ns_per_run: float  # median of the rounds
    spread_ns: float  # half the range of the rounds
    way: str  # "uprobe_multi link" or "perf-event uprobe"
    pairs: int  # malloc+free pairs per round

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
    (run_cnt). ~0.2 s."""
    path = libc.process_libc(os.getpid())
    if path is None:
        raise PymtraceError("cannot calibrate the uprobe trap cost: this Python maps no libc")
    plan = dict(probe_plan(path))
    sites = {False: [], True: []}  # ret -> file offsets
    for function in ("malloc", "free"):
        address = elf.symbol(path, function).address
        for kind, off, _program in plan.get(function, ()):
            sites[kind != "entry"].append(elf.code_offset(path, address + off))
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
        fds = []
        try:
            for ret, offsets in sites.items():
                if offsets:
                    fds += uprobes.attach_program(prog, path, offsets, os.getpid(), ret)
            per_run = []
            for base in untraced:
                cnt0, ns0 = _run_counts(prog)
                traced = loop(pairs)
                cnt1, ns1 = _run_counts(prog)
                if cnt1 <= cnt0:
                    raise PymtraceError("cannot calibrate the uprobe trap cost: the kernel counted no program run")
                per_run.append(max(traced - base - (ns1 - ns0), 0) / (cnt1 - cnt0))
        finally:
            for fd in fds:
                os.close(fd)
    except OSError as exc:
        raise PymtraceError(f"cannot calibrate the uprobe trap cost: {exc.strerror or exc}") from None
    finally:
        os.close(prog)
    way = "uprobe_multi link" if multi else "perf-event uprobe"
    return TrapCost(statistics.median(per_run), (max(per_run) - min(per_run)) / 2, way, pairs)


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
    bytes, size buckets), and what they grow by per CPU nanosecond of its own work."""

    est: list[float]
    cpu_mark: int  # the process's CPU ns up to which est accounts for its calls
    per_ns: list[float] | None = None  # from the last window; None before the first
    error: float | None = None  # relative, 95 %
    useful_fraction: float = 1.0  # of its CPU in the last window: its own work
    windows: int = 0
    sampled_calls: int = 0
    sampled_ns: int = 0  # its own CPU ns in the windows' measured parts
    base: list[float] | None = None  # est when the current window began
    pending_ns: int = 0  # CPU ns before its first window, estimated when it ends
    last_window: float | None = None
    recent: list[float] = dataclasses.field(default_factory=list)  # calls per ns, last windows


def _with_spread(error: float | None, recent: list[float]) -> float | None:
    """ERROR (relative, 95 %) of one window's calls per CPU ns with the spread of the RECENT
    windows' values added: how much the process's calls per CPU-second move between windows
    (its other work, the machine's load) is part of what a window can be off by."""
    if error is None or len(recent) < 2:
        return error
    mean = statistics.fmean(recent)
    spread = Z95 * statistics.stdev(recent) / mean if mean > 0 else 0.0
    return math.sqrt(error**2 + spread**2)


class _Measured:
    """A window's measured part (every probe attached): counters, CPU clocks and program runs
    read at its start and end, and each process's pace (CPU ns per ns) before the window."""

    def __init__(self, counts0: dict, cpu0: dict, runs0: tuple[int, int], t0: int, pace: dict) -> None:
        self.counts0, self.cpu0, self._runs0, self._t0, self.pace = counts0, cpu0, runs0, t0, pace

    def end(self, counts1: dict, cpu1: dict, runs1: tuple[int, int], t1: int) -> None:
        self.counts1, self.cpu1 = counts1, cpu1
        self.runs, self.bpf_ns = runs1[0] - self._runs0[0], runs1[1] - self._runs0[1]
        self.seconds = (t1 - self._t0) / 1e9


class WindowedMalloc(MallocSource):
    """MallocSource under a Budget: the same programs and counters, the uprobes attached in
    windows (module docstring); snapshot() gives estimated counters (no live bytes)."""

    def __init__(
        self,
        pids: Iterable[int | str] | None,
        budget: Budget,
        track_exits: bool = True,
        max_procs: int = 8192,
    ) -> None:
        super().__init__(pids, track_exits, max_procs)
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
        self._est: dict[int, _Estimate] = {}
        self._seen: dict[int, list[int]] = {}  # pid -> ms_stats totals at the last read
        self._meter = None
        self.in_window = False
        self.windows = 0
        self.window_ns = 0  # wall time with probes attached (attach start to detach end)
        self.trap_ns = 0  # runs x calibrated trap cost
        self.bpf_ns = 0  # BPF run time
        self.switch_ns = 0  # attach/detach CPU
        self.errors = []  # attach failures during windows (the first few)
        self._rate = None  # (trap + BPF) ns per ns of window, recent windows
        self._switch = None  # attach + detach CPU ns of a window, recent windows
        self._earned_at = 0.0  # useful CPU ns when the last window ended
        self._threshold = 0.0  # credit to earn before the next window (random)
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

    # -- attach: window 0, calibration, the thread
    def _attach_libc(self, path: str, pid: int, plan: list) -> None:
        self.attached += attach_plan(self.bpf, path, pid, plan, handles=self._handles)

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
        names = {
            prog
            for plans in (self.plans, self.cxx_plans)
            for plan in plans.values()
            for _, ps in plan
            for *_, prog in ps
        }
        self._prog_fds = [self.bpf.funcs[n.encode()].fd for n in sorted(names) if n.encode() in self.bpf.funcs]
        self._meter = _CpuMeter(self.pids)
        self._start_ns = time.monotonic_ns()
        self._last_cpu = (self._start_ns, self._cpu(self._candidates()))
        self._seen = self._read_counts()
        for pid in self.pids or ():
            cpu = proc.cpu_ns(pid)
            if cpu is not None:
                self._est[pid] = _Estimate([0.0] * self._width(), cpu)
        self._thread = threading.Thread(target=self._loop, name="pymtrace-budget", daemon=True)
        self._thread.start()

    def _width(self) -> int:
        return self._n_calls + 1 + self._n_sizes

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
    def _read_counts(self) -> dict[int, list[int]]:
        """{pid: counter vector} of every process in ms_stats (calls, requested bytes, sizes)."""
        out = {}
        for key, values in percpu_items(self.bpf[b"ms_stats"]):
            s = sum_percpu(values, self.fields)
            out[int(key.value)] = [*s["calls"], s["requested_bytes"], *s["size_log2"]]
        return out

    def _runs(self) -> tuple[int, int]:
        """(runs, BPF run ns) of the malloc programs attached to uprobes, since load."""
        cnt = ns = 0
        for fd in self._prog_fds:
            c, n = _run_counts(fd)
            cnt, ns = cnt + c, ns + n
        return cnt, ns

    def _cpu(self, pids: Iterable[int]) -> dict[int, int]:
        return {pid: ns for pid in pids if (ns := proc.cpu_ns(pid)) is not None}

    def _candidates(self) -> list[int]:
        """The processes a window may count: -p, those watched; else every process."""
        return list(self.pids) if self.pids is not None else libc.pids()

    # -- the budget
    def _useful_ns(self) -> int:
        """The traced processes' CPU ns since start on their own work (their CPU time minus
        the traps and BPF runs in it)."""
        return self._meter.update() - self.trap_ns - self.bpf_ns

    def _credit(self, useful: int) -> float:
        return self.budget.max_overhead / 100 * useful - (self.trap_ns + self.bpf_ns + self.switch_ns)

    def _predicted(self, length: float) -> float:
        """The cost (ns) of a window of LENGTH seconds, as the recent windows cost per second
        of their measured part, plus a window's fixed cost (the traps while its probes are
        attached and detached, and that CPU); 0 before the first window: it is taken without
        knowing, short, and the next ones wait until its cost is earned."""
        if self._rate is None:
            return 0.0
        return self._rate * length * 1e9 + self._switch

    def _next_length(self) -> float:
        return min(self.budget.window, FIRST_WINDOW) if self.windows == 0 else self.budget.window

    def _loop(self) -> None:
        poll = min(0.25, self.budget.window / 2)
        if self._stop.wait(self._rng.uniform(0, min(1.0, self.budget.window))):
            return
        while not self._stop.wait(poll if self.windows else 0):
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
        for table, plans in ((self.libcs, self.plans), (self.cxx, self.cxx_plans)):
            for path, pids in list(table.items()):
                for pid in pids:
                    try:
                        self._attach_libc(path, pid, plans[path])
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
            self._begin(start_cpu)
            self.in_window = True
        # each process's pace before the window: CPU ns per ns since the last window ended
        t_before, cpu_before = self._last_cpu
        pace = {
            pid: (ns - cpu_before[pid]) / (t0 - t_before)
            for pid, ns in start_cpu.items()
            if pid in cpu_before and t0 > t_before
        }
        runs0 = self._runs()
        began = time.thread_time_ns()
        self._attach_all()
        attach_ns = time.thread_time_ns() - began
        # the measured part: every probe attached (calls and CPU read at both ends)
        m = _Measured(self._read_counts(), self._cpu(candidates), self._runs(), time.monotonic_ns(), pace)
        self._stop.wait(length)
        m.end(self._read_counts(), self._cpu(m.cpu0), self._runs(), time.monotonic_ns())
        detach_ns = uprobes.release(self.bpf, self._handles) * 1e9
        self._handles = []
        runs1 = self._runs()
        counts = self._read_counts()
        end_cpu = self._cpu(set(counts) | set(self._est) | set(candidates))
        t1 = time.monotonic_ns()
        self._last_cpu = (t1, end_cpu)
        with self._state:
            runs, bpf_ns = runs1[0] - runs0[0], runs1[1] - runs0[1]
            trap_ns = runs * self.trap.ns_per_run
            self.windows += 1
            self.window_ns += t1 - t0
            self.trap_ns += int(trap_ns)
            self.bpf_ns += bpf_ns
            self.switch_ns += int(attach_ns + detach_ns)
            # the measured part's cost per ns, and the rest (traps while attaching and
            # detaching, the switch's CPU) as a window's fixed cost
            inside = m.runs * self.trap.ns_per_run + m.bpf_ns
            rate = inside / max(m.seconds * 1e9, 1)
            fixed = trap_ns + bpf_ns - inside + attach_ns + detach_ns
            self._rate = rate if self._rate is None else (self._rate + rate) / 2
            self._switch = (self._switch + fixed) / 2
            self._end(counts, end_cpu, self._per_ns(m), t1)
            self.in_window = False

    def _per_ns(self, m: _Measured) -> dict[int, tuple[list[float], float | None, float, int, int]]:
        """Per process of the window's measured part M: (counters per CPU ns of its own work,
        their relative error (95 %), its own work's fraction of its CPU, calls, own ns).

        Its own work: its CPU time minus its share of the traps and BPF runs (the calibrated
        model, +-TRAP_UNCERTAINTY of the traps' part, taken as the bound); where what it ran at its pace before the window
        lies within that range, the pace (a process that is not saturated keeps its pace,
        the traps adding to its CPU time; one that is, gives the traps part of it, and the
        model's value and uncertainty stand)."""
        deltas, weights = {}, {}
        for pid, c1 in m.counts1.items():
            if pid not in m.cpu0 or pid not in m.cpu1:
                continue
            c0 = m.counts0.get(pid)
            d = [b - a for a, b in zip(c0, c1)] if c0 is not None and c0[0] <= c1[0] else list(c1)
            deltas[pid] = d
            weights[pid] = 2 * sum(d[i] for i in self._alloc_idx) + sum(d[i] for i in self._free_idx)
        for pid in self._est:  # a known process that made no call: 0 per ns, not unknown
            if pid in m.cpu0 and pid in m.cpu1 and pid not in deltas:
                deltas[pid], weights[pid] = [0] * self._width(), 0
        total = sum(weights.values()) or 1
        out = {}
        for pid, d in deltas.items():
            cpu = m.cpu1[pid] - m.cpu0[pid]
            if cpu <= 0:
                continue
            share = weights[pid] / total
            trap = share * m.runs * self.trap.ns_per_run
            own = cpu - trap - share * m.bpf_ns  # the BPF run time is the kernel's count: exact
            sigma = trap * TRAP_UNCERTAINTY + share * m.runs * self.trap.spread_ns
            paced = m.pace.get(pid, math.inf) * m.seconds * 1e9
            if abs(paced - own) <= sigma:  # kept its pace, within what the model can tell
                own, sigma = paced, 0.0
            own = max(own, cpu / 20)  # never below a twentieth of its CPU: the model is not that exact
            calls = sum(d[: self._n_calls]) - (d[self._free_null] if self._free_null is not None else 0)
            error = math.sqrt(Z95**2 / calls + (sigma / own) ** 2) if calls else None
            out[pid] = ([x / own for x in d], error, own / cpu, calls, int(own))
        return out

    def _begin(self, cpu: dict[int, int]) -> None:
        """A window begins: every estimate brought up to CPU, its value kept as the base."""
        for pid, e in self._est.items():
            if pid in cpu:
                self._grow(e, cpu[pid], 1.0)
            e.base = list(e.est)

    def _grow(self, e: _Estimate, cpu: int, fraction: float) -> None:
        """E's counters grown to the process's CPU ns CPU (FRACTION of it its own work)."""
        d = cpu - e.cpu_mark
        if d <= 0:
            return
        if e.per_ns is None:
            e.pending_ns += d
        else:
            e.est = [v + k * d * fraction for v, k in zip(e.est, e.per_ns)]
        e.cpu_mark = cpu

    def _end(self, counts: dict[int, list[int]], cpu: dict[int, int], per_ns: dict, now_ns: int) -> None:
        """A window ended: each process's counters become the window's exact counts on top of
        their value at its start (never below what the snapshots showed meanwhile)."""
        width = self._width()
        for pid, c in counts.items():
            seen = self._seen.get(pid)
            d = [b - a for a, b in zip(seen, c)] if seen is not None and seen[0] <= c[0] else list(c)
            e = self._est.get(pid)
            if e is None:
                if pid not in per_ns or pid not in cpu:
                    continue
                e = self._est[pid] = _Estimate([0.0] * width, cpu[pid], base=[0.0] * width)
            if pid in per_ns:
                k, error, fraction, calls, own = per_ns[pid]
                if e.per_ns is None and e.pending_ns:  # before its first window: at the rate found now
                    e.base = [b + x * e.pending_ns for b, x in zip(e.base, k)]
                    e.pending_ns = 0
                e.recent = (e.recent + [sum(k[: self._n_calls])])[-RECENT:]
                e.per_ns, e.error, e.useful_fraction = k, _with_spread(error, e.recent), fraction
                e.windows += 1
                e.sampled_calls += calls
                e.sampled_ns += own
                e.last_window = now_ns / 1e9
            exact = [b + x for b, x in zip(e.base or e.est, d)]
            e.est = [max(a, b) for a, b in zip(e.est, exact)]
            if pid in cpu:
                e.cpu_mark = cpu[pid]
            e.base = None
        for pid, e in self._est.items():
            if e.base is not None:  # no entry in ms_stats: nothing counted
                if pid in per_ns:
                    k, error, fraction, calls, own = per_ns[pid]
                    e.per_ns, e.error, e.useful_fraction = k, error, fraction
                    e.windows += 1
                    e.sampled_ns += own
                    e.last_window = now_ns / 1e9
                    e.pending_ns = 0
                if pid in cpu:
                    e.cpu_mark = cpu[pid]
                e.base = None
        self._seen = counts

    # -- snapshots
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
            "probes": self.trap.way,
            "errors": list(self.errors),
        }

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        procs = {}
        with self._state:
            cpu = self._cpu(list(self._est))
            for pid, e in self._est.items():
                if pid in cpu:
                    self._grow(e, cpu[pid], e.useful_fraction if e.base is not None else 1.0)
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
                "sampled_cpu_seconds": e.sampled_ns / 1e9,
                "last_window_age": now - e.last_window if e.last_window is not None else None,
                "calls_per_cpu_second": sum(e.per_ns[: self._n_calls]) * 1e9 if e.per_ns is not None else None,
            },
        }
        if e.per_ns is not None:
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
