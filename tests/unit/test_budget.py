"""The overhead budget without BPF: its options, how a window's counts become a process's
pace (saturated or not), the views' and the exporter's estimates. Against real processes:
tests/live/test_top_budget.py and tests/live/test_exporter_bpf.py."""

import os
import time

import pytest
from support.cli import run_pymtrace
from support.exporter import FakeSource
from support.prometheus import parse_metrics, sample

from pymtrace.errors import PymtraceError
from pymtrace.sinks import prometheus, views
from pymtrace.sources import budget as b
from pymtrace.sources.snapshot import call_names


@pytest.mark.parametrize("pct, window", [(0, 1), (-1, 1), (101, 1), (float("nan"), 1), (1, 0.001), (1, 1e6)])
def test_bad_budgets_are_refused(pct, window):
    with pytest.raises(PymtraceError):
        b.Budget(pct, window).check()


@pytest.mark.parametrize(
    "args, says",
    [
        (("top", "--max-overhead", "0"), "--max-overhead"),
        (("top", "--window", "2"), "--window needs --max-overhead"),
        (("top", "--max-overhead", "1", "--always-on"), "contradict"),
        (("top", "--max-overhead", "1", "--stacks", "-p", "1"), "--stacks"),
        (("exporter", "--max-overhead", "1", "--per-call"), "--max-overhead"),
        (("exporter", "--window", "0.5", "--always-on"), "--window"),
        (("exporter", "--no-bpf-stats"), "--no-bpf-stats"),
    ],
)
def test_option_errors_are_one_line(args, says):
    r = run_pymtrace(*args)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_says_the_cost():
    for command in ("top", "exporter"):
        text = " ".join(run_pymtrace(command, "--help").stdout.split())
        assert "--max-overhead" in text and "ESTIMATES" in text.upper() and "calibrated" in text


def _source():
    src = b.WindowedMalloc(None, b.Budget(1))
    src.trap = b.TrapCost(ns_per_run=1000.0, spread_ns=0.0, way="test", pairs=0)
    return src


def _counts(src, malloc, free):
    v = [0] * src._width()
    index = {name: i for i, name in call_names().items()}
    v[index["malloc"]], v[index["free"]] = malloc, free
    return v


def _measured(src, pid, malloc, cpu_ns, pace, runs):
    """One window's measured part of 1 s: PID made MALLOC malloc+free pairs, ran CPU_NS of
    CPU time, PACE CPU ns per ns before the window; RUNS program runs, no BPF run time."""
    m = b._Measured({pid: _counts(src, 0, 0)}, {pid: 0}, (0, 0, 0.0), 0, {pid: pace})
    m.end({pid: _counts(src, malloc, malloc)}, {pid: cpu_ns}, (runs, 0, runs * 1000.0), 1_000_000_000)
    return m


def test_a_process_with_cpu_to_spare_keeps_its_pace():
    """10,000 pairs (30,000 runs: 30 ms of traps) on top of 0.2 CPU-s of its own work: its
    CPU time rose by the traps, so it is not saturated and its pace is as counted; the error
    is the count's."""
    src = _source()
    s = src._samples(_measured(src, 42, 10_000, 230_000_000, 0.2, 30_000))[42]
    assert not s.saturated and s.calls == 20_000 and s.trap_share == pytest.approx(30 / 230)
    per_s, error = b._rate([s])
    assert per_s[call_names_index("malloc")] == pytest.approx(10_000)
    assert error == pytest.approx(b.Z95 / 20_000**0.5)


def test_a_saturated_process_is_flagged_and_kept_at_its_pace_under_the_traps():
    """A CPU-bound process (1 CPU before and in the window) whose 0.75 s of traps left it
    0.25 s of its own work: saturated, its counts kept as counted (what tracing every call
    counts, a lower bound of its untraced pace), the error the count's, not a model's."""
    src = _source()
    s = src._samples(_measured(src, 42, 250_000, 1_000_000_000, 1.0, 750_000))[42]
    assert s.saturated and s.trap_share == pytest.approx(0.75)
    per_s, error = b._rate([s])
    assert per_s[call_names_index("malloc")] == pytest.approx(250_000)
    assert error == pytest.approx(b.Z95 / 500_000**0.5)


def test_a_process_whose_cpu_did_not_rise_by_the_traps_is_saturated():
    """Its CPU time rose by a tenth of the 0.3 s of traps the model gives it: the traps took
    its own work's time whatever the model's error (half of them), so saturated."""
    src = _source()
    s = src._samples(_measured(src, 42, 100_000, 530_000_000, 0.5, 300_000))[42]
    assert s.saturated


@pytest.mark.parametrize(
    "busiest, malloc, cpu_ns, saturated",
    [
        (1.0, 250_000, 1_000_000_000, True),  # never slept, traps 75 % of its CPU time
        (0.3, 100_000, 530_000_000, False),  # slept 70 % of the window: it had time to spare
        (1.0, 1_000, 1_000_000_000, False),  # CPU-bound, but the traps 0.3 % of it
    ],
)
def test_the_schedulers_counts_say_whether_a_process_is_saturated(busiest, malloc, cpu_ns, saturated):
    """Where its threads were read before and after the window, a process is saturated when
    one never slept (ran or waited to run 90 % of the window) and the traps took more than
    5 % of its CPU time: the CPU-time model is not consulted."""
    src = _source()
    m = _measured(src, 42, malloc, cpu_ns, 0.5, 3 * malloc)
    m.demand0, m.demand1 = {42: {42: 0, 43: 5}}, {42: {42: int(busiest * 1e9), 43: 10}}
    assert m.busiest(42) == pytest.approx(busiest)
    assert src._samples(m)[42].saturated is saturated


def test_a_threads_demand_is_over_the_time_between_its_reads():
    """The demand reads come after the counts and CPU clocks at each end: slower at the start
    (a VM's emulation), the part's own length would understate it. A thread that ran all of
    the 0.8 s between the reads of a 1 s part never slept."""
    m = b._Measured({}, {}, (0, 0, 0.0), 0, {}, {42: {42: 0}}, 150_000_000)
    m.end({}, {}, (0, 0, 0.0), 1_000_000_000, {42: {42: 800_000_000}}, 950_000_000)
    assert m.busiest(42) == pytest.approx(1.0)


def test_the_spread_between_windows_widens_the_error():
    src = _source()
    steady = [src._samples(_measured(src, 1, 10_000, 230_000_000, 0.2, 30_000))[1] for _ in range(3)]
    moving = [src._samples(_measured(src, 1, n, 230_000_000, 0.2, 3 * n))[1] for n in (5_000, 10_000, 15_000)]
    assert b._rate(steady)[1] < b._rate(moving)[1]
    assert b._rate(moving)[0][call_names_index("malloc")] == pytest.approx(15_000)  # the newest window's pace


def test_a_saturated_process_is_estimated_from_its_run_of_saturated_windows():
    """Saturated, its pace under the traps follows the CPU the scheduler gave it in each
    short window: its newest run of saturated windows is pooled (calls over their time), a
    window with CPU to spare before them is not; the spread's error is that of their mean."""
    src = _source()
    calm = src._samples(_measured(src, 1, 40_000, 230_000_000, 0.2, 30_000))[1]
    busy = [src._samples(_measured(src, 1, n, 1_000_000_000, 1.0, 3 * n))[1] for n in (200_000, 300_000, 250_000)]
    assert not calm.saturated and all(x.saturated for x in busy)
    per_s, error = b._rate([calm, *busy])
    assert per_s[call_names_index("malloc")] == pytest.approx(250_000)  # (200k + 300k + 250k) / 3 s
    one = b._rate([calm, busy[-1]])[1]
    assert error == pytest.approx(
        (b.Z95**2 / 1_500_000 + (b.Z95 * 0.2) ** 2 / 3) ** 0.5  # stdev/mean of 200k, 300k, 250k: 0.2
    )
    assert b._rate([busy[-1]])[1] < one  # one saturated window after a calm one: the spread of both


def test_a_saturated_process_pools_at_most_its_newest_pooled_windows():
    """Its newest POOLED saturated windows, not older ones (a pace that moves is followed),
    and its estimate keeps that many; one with CPU to spare keeps the spread of its last
    RECENT windows only."""
    src = _source()
    old = [src._samples(_measured(src, 1, 100_000, 1_000_000_000, 1.0, 300_000))[1] for _ in range(4)]
    new = [src._samples(_measured(src, 1, 200_000, 1_000_000_000, 1.0, 600_000))[1] for _ in range(b.POOLED)]
    assert all(x.saturated for x in old + new)
    per_s, _ = b._rate(old + new)
    assert per_s[call_names_index("malloc")] == pytest.approx(200_000)
    e = b._Estimate([0.0] * src._width(), 0, base=[0.0] * src._width())
    for x in old + new:
        b.WindowedMalloc._learn(e, x, 1)
    assert len(e.recent) == b.POOLED and e.per_s[call_names_index("malloc")] == pytest.approx(200_000)
    calm = [src._samples(_measured(src, 1, n, 230_000_000, 0.2, 30_000))[1] for n in (1_000, 1_000, 40_000)]
    spread = [src._samples(_measured(src, 1, 40_000, 230_000_000, 0.2, 30_000))[1] for _ in range(b.RECENT)]
    assert b._rate(calm + spread)[1] == pytest.approx(b._rate(spread)[1])


class _Switch:
    """The kernel's BPF statistics switch (BpfStats): whether they are on."""

    def __init__(self):
        self.on, self.switched = False, 0

    def enable(self):
        self.on, self.switched = True, self.switched + 1
        return True

    def close(self):
        self.on = False


class _Counting(b.Windows):
    """The scheduler over a process that makes 100 malloc+free pairs (300 runs: 900 ns of
    trap and 50 of BPF each) between two readings of its counters; the kernel's statistics
    count those made while they are on. Each measured part's end is kept with whether the
    statistics were on when it began."""

    counts_runs = True

    def __init__(self):
        self.pids, self.bpf = [1], _Switch()  # (any object: no probes to release)
        self._init_windows(b.Budget(1, 0.02))
        self._bpfstats = _Switch()
        self.n = self.stats_n = 0
        self.parts_read = []  # (n at the measured part's start, statistics on then)
        self._meter = b._CpuMeter([os.getpid()])
        self._start_ns = time.monotonic_ns()
        self._last_cpu = (self._start_ns, self._cpu(self.pids))
        self.measured = []

    def _window_attachments(self):
        return ()

    def _read_counts(self):
        self.n += 100
        self.stats_n += 100 if self._bpfstats.on else 0
        self.parts_read.append((self.n, self._bpfstats.on))
        return {1: [self.n]}

    def _runs(self):
        runs = 3 * self.stats_n
        return runs, 50 * runs, 900.0 * runs

    def _cpu(self, pids):
        return {1: 10_000 * self.n}  # 10 us a pair: the traps never more than it ran

    def _counted_runs(self, before, after):
        return sum(3 * (c[0] - before.get(pid, [0])[0]) for pid, c in after.items())

    def _window_closes(self, m, counts, start_ns, now_ns):
        self.measured.append((m, dict(self.parts_read)[m.counts0[1][0]]))
        return 0


def test_the_statistics_price_a_counted_run_and_are_off_where_the_pace_is_measured():
    """A window with the BPF statistics has them on for a part before its measured part only
    (half its length more): the trap and BPF ns of a counted run are found there, and its
    measured part (a saturated process's pace: the statistics slow every run), as long as
    any window's, begins after they went off, its runs counted and priced at them; the next
    windows do not turn them on until the 4th after. Each window's cost is every run it
    made at that price, and the one with the statistics is predicted to cost that more."""
    w = _Counting()
    w._window(0.02)
    assert w._per_counted == (900.0, 50.0) and w._bpfstats.switched == 1 and not w._bpfstats.on
    (m, on), runs = w.measured[0], 3 * w.n  # (the statistics counted from before the first reading)
    assert not on and m.runs == 300 and (m.bpf_ns, m.trap_ns) == (300 * 50, 300 * 900.0)
    assert m.seconds >= 0.02
    assert (w.bpf_ns, w.trap_ns) == (50 * runs, 900 * runs)
    w._window(0.02)
    assert w._bpfstats.switched == 1 and not w.measured[1][1] and w.stats_windows == 1
    plain = w._predicted(1.0)
    w.windows = b.STATS_EVERY
    assert w._stats_part() == b.STATS_PART
    assert w._predicted(1.0) - w._switch == pytest.approx((plain - w._switch) * (1 + b.STATS_PART))


def test_a_windows_runs_are_counted_where_the_statistics_are_off():
    """Without the BPF statistics a window's program runs are those its counters tell: 2 an
    allocating call (entry and return probes), 1 a free; a process new to the table counts
    all it has; each costs the trap and BPF ns a counted run had with them on."""
    src = _source()
    before = {1: _counts(src, 100, 100)}
    after = {1: _counts(src, 150, 120), 2: _counts(src, 10, 0)}
    assert src._counted_runs(before, after) == 2 * 50 + 20 + 2 * 10
    src._per_counted = (900.0, 60.0)
    assert src._counted(before, after) == (140, 140 * 60, 140 * 900.0)


def test_windows_shorten_while_a_process_is_saturated():
    """Saturated, a window costs about its length: as long as the budget affords every
    SATURATED_SPACING seconds at the traced CPU pace (2 % of 1 CPU over that spacing, less
    the attach and detach), never below SATURATED_MIN_WINDOW; so too where no process was
    judged saturated but the traps took most of the CPU time (a thread that slept a little
    in a short window); with CPU to spare, --window."""
    src = b.WindowedMalloc([os.getpid()], b.Budget(2, 1.0))
    src._rate, src._switch, src._then = 1.0, 2e6, (1.0, 1.0)
    src._est[os.getpid()] = b._Estimate([0.0], 0, saturated=True)
    assert src._next_length() == pytest.approx(0.02 * b.SATURATED_SPACING - 0.002)
    src.budget = b.Budget(0.1, 1.0)
    assert src._next_length() == b.SATURATED_MIN_WINDOW
    src._est[os.getpid()].saturated = False
    assert src._next_length() == b.SATURATED_MIN_WINDOW  # the traps took all of its CPU
    src._rate = 0.2
    assert src._next_length() == 1.0


def test_heaps_windows_shorten_where_the_traps_took_most_of_the_cpu():
    """heap judges no process alone: its windows shorten when the traps and BPF runs took
    most of the CPU time the traced processes ran in the last window (2 % of 1 CPU over
    SATURATED_SPACING, less the attach and detach, at 0.9 of it), not when they took a fifth."""
    src = b.WindowedHeap([os.getpid()], b.Budget(2, 1.0))
    assert src._next_length() == b.FIRST_WINDOW  # before a window has seen calls
    src._rate, src._switch, src._then = 0.9, 2e6, (1.0, 1.0)
    assert src._next_length() == pytest.approx((0.02 * b.SATURATED_SPACING - 0.002) / 0.9)
    src._rate = 0.2
    assert src._next_length() == 1.0


def call_names_index(name):
    return {n: i for i, n in call_names().items()}[name]


def test_a_process_is_estimated_between_windows_at_its_pace():
    """Counters grow at the last window's pace between windows and in a window from its
    start; never down."""
    src = _source()
    e = b._Estimate([0.0] * src._width(), 0)
    src._est[7] = e
    src._begin(0)
    sample = src._samples(_measured(src, 7, 1_000, 300_000_000, 0.2, 3_000))[7]
    src._end({7: _counts(src, 1_000, 1_000)}, {7: sample}, 0, 1_000_000_000)
    i = call_names_index("malloc")
    assert e.est[i] == pytest.approx(1_000)
    src._grow(e, 3_000_000_000)
    assert e.est[i] == pytest.approx(3_000)


def _budget_snapshot():
    calls = {name: 0 for name in call_names().values()}
    calls.update(malloc=1000, free=900)
    return {
        "time": 2.0,
        "start": 0.0,
        "processes": {
            7: {
                "pid": 7,
                "comm": "app",
                "calls": calls,
                "requested_bytes": 64000,
                "size_log2": [0] * 65,
                "estimated": True,
                "estimate": {
                    "windows": 2,
                    "error": 0.05,
                    "sampled_calls": 500,
                    "sampled_seconds": 0.4,
                    "last_window_age": 0.5,
                    "calls_per_second": 950.0,
                    "saturated": True,
                    "trap_share": 0.9,
                },
                "rss_bytes": 1 << 20,
                "rss_anon_bytes": 1 << 19,
                "rss_anon_base_bytes": 1 << 18,
            }
        },
        "lost": {},
        "budget": {
            "max_overhead_pct": 1.0,
            "window_seconds": 1.0,
            "windows": 2,
            "attached": False,
            "duty_cycle": 0.02,
            "overhead_pct": 0.8,
            "traced_cpu_seconds": 10.0,
            "cost_seconds": {"traps": 0.06, "bpf": 0.01, "attach_detach": 0.01},
            "trap_ns_per_run": 900.0,
            "trap_spread_ns": 20.0,
            "trap_single_step_ns": 4000.0,
            "probes": "uprobe_multi link",
            "errors": [],
        },
    }


def test_views_say_estimates_with_their_error_and_no_live_bytes():
    cur = _budget_snapshot()
    table = views.build("processes", None, cur)
    keys = [c.key for c in table.columns]
    row = dict(zip(keys, table.rows[0]))
    assert row["estimate_error_pct"] == pytest.approx(5.0) and row["live_bytes"] is None
    assert row["malloc_per_s"] == pytest.approx(500)  # 1000 since start, 2 s
    assert any(n.startswith("ESTIMATES under a 1% overhead budget") for n in table.notes)
    assert "0.80%" in table.notes[0] and "ESTIMATES" in views.summary(table)
    assert any(n.startswith("SATURATED") and "PID 7:" in n and "lower bound" in n for n in table.notes)
    heap = views.build("heap", None, cur)
    assert any("live bytes" in n and "not measured" in n for n in heap.notes)
    exact = {k: v for k, v in cur.items() if k != "budget"}
    assert "estimate_error_pct" not in [c.key for c in views.build("processes", None, exact).columns]


def test_exporter_exports_estimates_apart_with_the_budget_gauges():
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        prometheus.ExporterMetrics([FakeSource(_budget_snapshot())], prometheus.Aggregator(alive=lambda p: True))
    )
    m = parse_metrics(generate_latest(reg).decode())
    assert sample(m, "pymtrace_malloc_calls_estimated_total", comm="app", call="malloc") == 1000
    assert sample(m, "pymtrace_malloc_requested_bytes_estimated_total", comm="app") == 64000
    assert sample(m, "pymtrace_malloc_estimate_error_ratio", comm="app") == pytest.approx(0.05)
    assert sample(m, "pymtrace_malloc_estimate_saturated_processes", comm="app") == 1
    assert not [k for k in m if k[0] in ("pymtrace_malloc_calls_total", "pymtrace_malloc_requested_bytes_total")]
    assert sample(m, "pymtrace_exporter_duty_cycle") == pytest.approx(0.02)
    assert sample(m, "pymtrace_exporter_overhead_ratio") == pytest.approx(0.008)
    assert sample(m, "pymtrace_exporter_overhead_budget_ratio") == pytest.approx(0.01)
    assert sample(m, "pymtrace_exporter_sampling_windows_total") == 2
