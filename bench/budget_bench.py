#!/usr/bin/env python3
"""Benchmark of the overhead budget (`pymtrace top -p PID --max-overhead PCT`; not a test).

    sudo /opt/pymtrace/venv/bin/python bench/budget_bench.py [--rounds 2] [--budget 1] [--markdown]
        [--workloads storm,redis,steps]

1. Attach/detach: the CPU and wall time of attaching and detaching top's malloc probe set
   for one process (what every window pays), as uprobe_multi links and as perf-event
   uprobes (PYMTRACE_FAKE_NO_UPROBE_MULTI: the way of kernels without links, Debian 12's 6.1).
2. The storm (bench/storm.c: malloc(64)+free pairs, one thread, CPU-bound) and redis-server
   (jemalloc) under `redis-benchmark -t set,lpush -d 200 -r 1000000 -c 10`, each untraced,
   under `top -p PID --always-on` (no malloc probe: the page-fault tracepoint top's
   processes view runs in every mode, and top's own CPU time beside it), under `top -p PID
   --max-overhead PCT`, and under `top -p PID` (every call), in
   interleaved rounds: the traced process's slowdown (storm: its CPU ns per pair, also over
   that of a control storm running untraced beside it all the while, in its own batches:
   this shared machine's noise moves a storm's CPU time a pair by 5-10 % between phases,
   and cancels in that ratio; redis: requests/s) against the untraced run of the same
   round and against top --always-on's (the windows' own share), and the malloc-API call
   rate top estimated under the budget (its estimated calls' growth a second inside the
   run; beside it the pace of its last windows) against the rate full tracing counted in
   the same round (storm: 2 calls a pair at its mean ns per pair; redis: the calls top
   counted over the benchmark's wall time, the mean of a run just before the budget's and
   one just after it: redis-server's lists grow with every LPUSH, and its pace traced
   every call falls with them), and, for redis-server, over the rate the windows' own
   programs counted tracing every call (in this process, beside top --always-on, also just
   before and just after the budget's run: top's full tracing keeps jemalloc's blocks for
   its live bytes, a map update at each call, and a saturated process is slower under those
   traps than under the windows'), beside the untraced rate (storm:
   its untraced ns per pair; redis: its untraced requests/s x the calls a request full
   tracing counted): both are saturated, so their estimates are their pace under the traps.
3. Steps (tests/support/workloads/top_budget.c: paced mallocs, ~100 us of work each, at
   rates changing in steps), under the budget and under full tracing: each step's
   estimated rate (from its seventh second on: the estimates follow a step at the next
   window, every ~3 s at 1 %) against the calls the workload counted itself and those
   full tracing counted.
4. The storm and redis-server under `heap -p PID --max-overhead PCT` (in their rounds): the
   storm's CPU ns per pair and redis-server's requests/s against the untraced run of the
   same round, and heap's closing lines (the estimate's windows and coverage, the measured
   cost).

Each phase runs about a minute by default: a saturated process's window costs it about its
whole length, so at 1 % it gets a 0.05 s window every ~8 s of its CPU time, and its
estimate pools its newest few.

Every process runs on a private copy of the system libc named libc.so.6 (LD_LIBRARY_PATH;
redis-server's jemalloc is its own file): uprobes are per file, and other tools on a shared
machine probing the system libc would slow every process down. Only ratios inside one run
mean anything: the machine is shared and noisy.
"""

import argparse
import json
import os
import pathlib
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
FULL_AFTER = "every call, after"  # full tracing again after the budget's run (redis-server)
# every call traced with the windows' programs, before and after the budget's run (redis-server)
SAME, SAME_AFTER = "every call, windows' programs", "every call, windows' programs, after"
REDIS_TESTS = ("set", "lpush")  # redis-benchmark -t, one run each
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchutil import build_c, cpu_seconds, print_table, start_storm  # noqa: E402

from pymtrace.bpf import uprobes  # noqa: E402
from pymtrace.sources.base import attach_plan  # noqa: E402
from pymtrace.sources.budget import WINDOW_DEFINES  # noqa: E402
from pymtrace.sources.malloc import MallocSource  # noqa: E402
from pymtrace.tracee import libc  # noqa: E402

PY = [sys.executable, "-m", "pymtrace"]


def private_env(tmp):
    shutil.copy2(libc.system_libc(), tmp / "libc.so.6")
    return dict(os.environ, LD_LIBRARY_PATH=str(tmp), PYTHONPATH=str(ROOT))


class Top:
    """`pymtrace top --json -p PID ARGS` running, its documents read as they come (a thread:
    top never blocks on a full pipe) and handed out on demand."""

    def __init__(self, pid, args, env):
        self.proc = subprocess.Popen(
            PY + ["top", "--json", "-i", "1", "--no-glibc", "--view", "processes", "-p", str(pid), *args],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = pid
        self.seen = []  # every document handed out
        self.docs = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.last = self.before = self.doc()

    def _read(self):
        for line in self.proc.stdout:
            self.docs.put(json.loads(line))
        self.docs.put(None)

    def doc(self):
        d = self.docs.get(timeout=120)
        if d is None:
            raise SystemExit("top ended early")
        self.seen.append(d)
        return d

    def after(self, t):
        """The first document after T; self.before: the last one up to T (whose estimates
        rest on windows inside the run: a window after it would find the workload idle)."""
        while True:
            d = self.doc()
            if d["time"] > t:
                self.last = d
                return d
            self.before = d

    def mallocs(self, d, call=None):
        """The malloc-API calls (CALL: that call's) counted or estimated for the process in D."""
        calls = d["snapshot"]["processes"].get(str(self.pid), {}).get("calls", {})
        return calls.get(call, 0) if call else sum(calls.values())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


class _Probed(MallocSource):
    """top's malloc source, keeping what its attach added (for uprobes.release)."""

    handles = []

    def _attach_libc(self, path, pid, plan):
        self.attached += attach_plan(self.bpf, path, pid, plan, handles=self.handles)


class SamePrograms(MallocSource):
    """Every call of the process traced, here, with the windows' programs
    (budget.WINDOW_DEFINES: no live bytes), its calls counted as top counts them (its
    snapshot's, summed as Top.mallocs sums them): what a
    saturated process's estimate, its pace under the windows' traps, is measured against
    (top's full tracing keeps other allocators' blocks, a map update at each call: its traps
    cost more, and a saturated process's pace under them is lower)."""

    def _defines(self):
        return {**super()._defines(), **WINDOW_DEFINES}

    def calls(self, pid):
        return sum(self.snapshot()["processes"].get(pid, {}).get("calls", {}).values())


def switch_costs(env, tmp, rounds):
    """[(way, attach CPU ms, attach wall ms, detach CPU ms, detach wall ms)], medians."""
    exe = build_c(tmp, "idle", source="#include <unistd.h>\nint main(void) { pause(); return 0; }\n")
    idle = subprocess.Popen([exe], env=env)
    time.sleep(0.2)
    out = []
    try:
        src = _Probed([idle.pid], track_exits=False).attach()
        uprobes.release(src.bpf, src.handles)  # its own attach's probes gone: the rounds attach again
        for way, fake in (("uprobe_multi link", None), ("perf-event uprobe", "1")):
            if fake:
                os.environ[uprobes.FAKE_NO_MULTI_ENV] = fake
            uprobes.multi_links.cache_clear()
            if fake is None and not uprobes.multi_links():
                continue
            rows = []
            for _ in range(rounds):
                handles = []
                w0, c0 = time.perf_counter(), time.thread_time()
                for path, pids in src.libcs.items():
                    attach_plan(src.bpf, path, pids[0], src.plans[path], handles=handles)
                w1, c1 = time.perf_counter(), time.thread_time()
                cpu = uprobes.release(src.bpf, handles)
                w2 = time.perf_counter()
                rows.append(((c1 - c0) * 1e3, (w1 - w0) * 1e3, cpu * 1e3, (w2 - w1) * 1e3))
            out.append((way, *(statistics.median(col) for col in zip(*rows))))
        os.environ.pop(uprobes.FAKE_NO_MULTI_ENV, None)
        uprobes.multi_links.cache_clear()
        src.close()
    finally:
        idle.kill()
        idle.wait()
    return out


class Heap:
    """`pymtrace heap -p PID ARGS -o TMP/heap.pb.gz` running (started: its line saying it
    samples read), stopped with SIGINT; its closing lines kept (the estimate, the budget)."""

    def __init__(self, pid, args, env, tmp):
        self.proc = subprocess.Popen(
            PY + ["heap", "-p", str(pid), *args, "--force", "-o", str(tmp / "heap.pb.gz")],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for line in self.proc.stderr:
            if line.startswith("pymtrace heap: sampling"):
                break
        else:
            raise SystemExit("heap ended early")

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        self.lines = self.proc.stderr.read().splitlines()
        self.proc.wait(60)
        return self.lines


class Storm:
    """A storm process (bench/storm.c) reading "N SIZE" lines, its pid."""

    def __init__(self, exe, env):
        self.proc, self.pid = start_storm([exe], env)

    def send(self, pairs):
        self.proc.stdin.write(f"{pairs} 64\n")
        self.proc.stdin.flush()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


class Control(Storm):
    """An untraced storm running batches of PAIRS pairs back to back in its own thread, beside
    the traced storm's phases: what the machine's noise did to a storm then (never in step
    with the traced storm, which would wait for it between batches and idle in a window)."""

    def __init__(self, exe, env, pairs=5_000_000):
        super().__init__(exe, env)
        self.pairs, self.done = pairs, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.send(self.pairs)
            self.proc.stdout.readline()
            self.done += self.pairs + 1000  # (storm.c's 1000 warm-up pairs a batch)

    def mark(self):
        """(its CPU seconds, the pairs of its finished batches): a batch in progress at each
        end is off by at most one batch (~45 ms of a minute)."""
        return cpu_seconds(self.pid), self.done

    def close(self):
        self._stop.set()
        self._thread.join()
        super().close()


def storm_batches(storm, control, batches, pairs):
    """BATCHES batches of PAIRS malloc(64)+free pairs in STORM, beside CONTROL running on:
    STORM's median ns a pair, its CPU ns a pair, its wall seconds, and CONTROL's CPU ns a
    pair over the same time."""
    cpu0, ctl0, t0 = cpu_seconds(storm.pid), control.mark(), time.monotonic()
    ns = []
    for _ in range(batches):
        storm.send(pairs)
        ns.append(float(storm.proc.stdout.readline()))
    n = batches * (pairs + 1000)
    ctl1 = control.mark()
    return {
        "ns_pair": statistics.median(ns),
        "mean_ns_pair": statistics.fmean(ns),
        "cpu_ns_pair": (cpu_seconds(storm.pid) - cpu0) / n * 1e9,
        "seconds": time.monotonic() - t0,
        "control_cpu_ns_pair": (ctl1[0] - ctl0[0]) / (ctl1[1] - ctl0[1]) * 1e9 if ctl1[1] > ctl0[1] else None,
    }


def storm_round(storm, control, mode, args, env, batches, pairs, tmp=None):
    if mode.startswith("heap"):
        heap = Heap(storm.pid, args, env, tmp)
        res = storm_batches(storm, control, batches, pairs)
        lines = heap.stop()
        res["heap"] = tuple(next((x for x in lines if word in x), "") for word in ("ESTIMATE", "measured cost"))
        return res
    top = Top(storm.pid, args, env) if mode != "untraced" else None
    t0 = time.monotonic()
    res = storm_batches(storm, control, batches, pairs)
    # what full tracing counts, at its pace over the run (always-on: no malloc probe, no count)
    res["calls_s"] = 2e9 / res["mean_ns_pair"] if mode != "always-on" else None
    res["share"] = res["cpu_ns_pair"] / res["ns_pair"]  # the CPU it was given
    if top:
        top.after(time.monotonic())
        estimate(res, top, t0, t0 + res["seconds"])
        top.stop()
    return res


def against_control(run, base):
    """RUN's slowdown against BASE (the untraced run of its round, or another mode's), each
    over the control storm's CPU time a pair beside it: the machine's noise in both cancels
    (None: no control batch ended within one of them)."""
    if not run["control_cpu_ns_pair"] or not base["control_cpu_ns_pair"]:
        return None
    return (run["cpu_ns_pair"] / run["control_cpu_ns_pair"]) / (base["cpu_ns_pair"] / base["control_cpu_ns_pair"])


def estimate(res, top, t0, t1):
    """RES gains the budget's state and, under a budget, TOP's process's estimated call rate
    over the run [T0, T1]: its estimated calls' growth a second from the first document
    inside the run that has them to the last one inside it (the estimates carry each
    window's pace over the time after it: a workload whose pace moves, redis-benchmark's SET
    test then its LPUSH test, is compared with full tracing's count over the same run, not
    with the pace of its last windows), with the estimate's error and saturation there."""
    inside = [d for d in top.seen if t0 <= d["time"] <= t1]
    d = inside[-1] if inside else top.before
    res["budget"] = d["snapshot"].get("budget")
    if res["budget"]:
        e = d["snapshot"]["processes"][str(top.pid)].get("estimate", {})
        res["calls_s"] = inside_rate(top, t0, t1)
        res["pace"] = e.get("calls_per_second")  # its last windows'
        # each window's outcome as the reports saw it: (seconds into the run, pace, saturated)
        paces = {}
        for x in top.seen:
            xe = x["snapshot"]["processes"].get(str(top.pid), {}).get("estimate", {})
            if xe.get("windows") and xe["windows"] not in paces and xe.get("calls_per_second") is not None:
                paces[xe["windows"]] = (round(x["time"] - t0, 1), round(xe["calls_per_second"]), xe["saturated"])
        res["windows_seen"] = list(paces.values())
        res["all_windows"] = all_windows(top, t0, t1)
        res["error"], res["saturated"] = e.get("error"), e.get("saturated")
        res["share"] = e["sampled_cpu_seconds"] / e["sampled_seconds"] if e.get("sampled_seconds") else None


def inside_rate(top, t0, t1):
    """TOP's process's malloc-API calls a second (counted, or estimated under a budget) from
    the first report inside [T0, T1] that has them to the last one inside it (None: fewer
    than two)."""
    counted = [x for x in top.seen if t0 <= x["time"] <= t1 and top.mallocs(x)]
    if len(counted) < 2:
        return None
    a, b = counted[0], counted[-1]
    return (top.mallocs(b) - top.mallocs(a)) / (b["time"] - a["time"])


def all_windows(top, t0, t1):
    """(pace, its relative 95 % error, windows) of every window of TOP's process reported inside [T0,
    T1]: their calls over their measured seconds (from the growth of `sampled_calls` and
    `sampled_seconds` between reports), and the error of that mean from the spread of the
    windows' paces (1.96 standard errors; None below two windows). What the run's windows
    can tell, however the estimate carries them between windows: a run whose estimate is
    off by more than this was unlucky in its windows or measures something else."""
    paces, calls, seconds, prev = [], 0, 0.0, None
    for x in top.seen:
        e = x["snapshot"]["processes"].get(str(top.pid), {}).get("estimate")
        if not e:
            continue
        if prev and t0 <= x["time"] <= t1 and e["windows"] > prev["windows"]:
            c, s = e["sampled_calls"] - prev["sampled_calls"], e["sampled_seconds"] - prev["sampled_seconds"]
            if s > 0:
                paces.append(c / s)
                calls, seconds = calls + c, seconds + s
        prev = e
    if not seconds:
        return None, None, 0
    pace = calls / seconds
    error = 1.96 * statistics.stdev(paces) / statistics.fmean(paces) / len(paces) ** 0.5 if len(paces) > 1 else None
    return pace, error, len(paces)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_round(server, port, mode, args, env, requests, tmp):
    heap = Heap(server.pid, args, env, tmp) if mode.startswith("heap") else None
    # the windows' programs on every call beside top --always-on (its own share, as in the
    # budget's run)
    same = SamePrograms([server.pid], track_exits=False).attach() if mode.startswith(SAME) else None
    top = Top(server.pid, ["--always-on"] if same else args, env) if mode != "untraced" and not heap else None
    cpu0 = cpu_seconds(server.pid)
    # each test on its own, back to back, its span kept: under the traps SET and LPUSH pace
    # differently, and full tracing spends longer on the slower one than an untraced run does.
    # (time, the windows' programs' calls) at the first test's start and each test's end
    marks = [(time.monotonic(), same and same.calls(server.pid))]
    rates = []
    for test in REDIS_TESTS:
        out = subprocess.run(
            ["redis-benchmark", "-p", str(port), "-t", test, "-d", "200", "-r", "1000000", "-c", "10"]
            + ["-n", str(requests), "-q", "--csv"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rates += [float(line.split(",")[1].strip('"')) for line in out.splitlines()[1:] if line.strip()]
        marks.append((time.monotonic(), same and same.calls(server.pid)))
    (t0, calls0), (t1, calls1) = marks[0], marks[-1]
    spans = list(zip(REDIS_TESTS, marks, marks[1:]))  # (test, (start, calls), (end, calls))
    res = {"req_s": statistics.fmean(rates), "requests": requests * len(rates)}
    res["share"] = (cpu_seconds(server.pid) - cpu0) / (t1 - t0)
    if same:
        res["calls_s"], res["calls_request"] = (calls1 - calls0) / (t1 - t0), (calls1 - calls0) / res["requests"]
        res["tests"] = {test: {"calls_s": (c1 - c0) / (b - a)} for test, (a, c0), (b, c1) in spans}
        same.close()
        top.stop()
        return res
    if heap:
        lines = heap.stop()
        res["heap"] = tuple(next((x for x in lines if word in x), "") for word in ("ESTIMATE", "measured cost"))
    if top:
        before = top.mallocs(top.last)
        d = top.after(t1)
        res["calls_s"] = (top.mallocs(d) - before) / (t1 - t0)  # full tracing: every call counted
        res["calls_request"] = (top.mallocs(d) - before) / res["requests"]
        estimate(res, top, t0, t1)
        # each test's own: counted (every call) or estimated from the reports inside it
        res["tests"] = {test: {"calls_s": inside_rate(top, a, b)} for test, (a, _), (b, _) in spans}
        if res["budget"]:
            for test, (a, _), (b, _) in spans:
                res["tests"][test]["all_windows"] = all_windows(top, a, b)
        top.stop()
    return res


def summarize(name, results, speed, untraced_calls_s):
    """Rows: per mode the median speed (SPEED key) and its slowdown against the untraced run
    of the same round; the call rate counted (every call) or estimated (budget), and per
    round the estimate over the rate full tracing counted in that round (and, where the
    windows' programs traced every call too, over that rate)."""
    rows = []
    full = results["every call"]
    # a workload whose state drifts over the run (redis-server's lists grow with every LPUSH:
    # its pace traced every call fell 10 % over a budget run, measured) is compared with the
    # mean of full tracing before and after the budget's run
    full_s = [f["calls_s"] for f in full]
    if FULL_AFTER in results:
        full_s = [(f["calls_s"] + a["calls_s"]) / 2 for f, a in zip(full, results[FULL_AFTER])]
    same_s = [(f["calls_s"] + a["calls_s"]) / 2 for f, a in zip(results.get(SAME, []), results.get(SAME_AFTER, []))]
    for mode, runs in results.items():
        ratios = [r[speed] / u[speed] for r, u in zip(runs, results["untraced"])]
        row = {"workload": name, "mode": mode, speed: f"{statistics.median(r[speed] for r in runs):.1f}"}
        row["vs untraced"] = "/".join(f"{x:.3f}x" for x in ratios)
        if "control_cpu_ns_pair" in runs[0]:
            row["vs untraced, each over the control"] = "/".join(
                fmt(against_control(r, u), ".3f", after="x") for r, u in zip(runs, results["untraced"])
            )
        # the windows' own effect: against top with no malloc probe (its page-fault
        # tracepoint and its own CPU time are in both), over the control where there is one
        row["vs always-on"] = ""
        if runs[-1].get("budget") and "always-on" in results:
            row["vs always-on"] = "/".join(
                fmt(against_control(r, a) if "control_cpu_ns_pair" in r else r[speed] / a[speed], ".3f", after="x")
                for r, a in zip(runs, results["always-on"])
            )
        if mode == "untraced":
            rates = [untraced_calls_s(u, f) for u, f in zip(runs, full)]
            row["calls/s"] = "/".join(f"{x:,.0f}" for x in rates)
        else:
            row["calls/s"] = "/".join(f"{r['calls_s']:,.0f}" if r["calls_s"] else "-" for r in runs)
        row |= dict.fromkeys(("estimated / full tracing", "its last windows' pace / full"), "")
        row |= dict.fromkeys(("estimated / windows' programs", "pace / windows' programs", "error (95%)"), "")
        row |= dict.fromkeys(("all windows / full", "all windows / windows' programs"), "")
        row |= dict.fromkeys(("saturated", "CPU share"), "")
        row["measured overhead %"] = ""
        row["windows"] = ""
        b = runs[-1].get("budget")
        if b:
            row["estimated / full tracing"] = "/".join(
                f"{r['calls_s'] / f:.3f}" if r["calls_s"] else "no window" for r, f in zip(runs, full_s)
            )
            row["its last windows' pace / full"] = "/".join(
                fmt(r["pace"] and r["pace"] / f, ".3f") for r, f in zip(runs, full_s)
            )
            if same_s:
                row["estimated / windows' programs"] = "/".join(
                    fmt(r["calls_s"] and r["calls_s"] / f, ".3f") for r, f in zip(runs, same_s)
                )
                row["pace / windows' programs"] = "/".join(
                    fmt(r["pace"] and r["pace"] / f, ".3f") for r, f in zip(runs, same_s)
                )
            row["all windows / full"] = "/".join(_over(r["all_windows"], f) for r, f in zip(runs, full_s))
            if same_s:
                row["all windows / windows' programs"] = "/".join(
                    _over(r["all_windows"], f) for r, f in zip(runs, same_s)
                )
            row["error (95%)"] = "/".join(f"±{100 * r['error']:.1f} %" if r["error"] else "-" for r in runs)
            row["saturated"] = "/".join(str(r["saturated"]) for r in runs)
            row["CPU share"] = "/".join(fmt(r.get("share"), ".2f") for r in runs) + " (in its window)"
            row["measured overhead %"] = "/".join(f"{r['budget']['overhead_pct'] or 0:.2f}" for r in runs)
            row["windows"] = "/".join(str(r["budget"]["windows"]) for r in runs)
        if mode.startswith("every call"):
            row["CPU share"] = "/".join(fmt(r.get("share"), ".2f") for r in runs)
        rows.append(row)
    return rows


def _over(windows, reference):
    """'PACE/REFERENCE ±ERROR %' of all_windows()'s (pace, error, windows)."""
    pace, error, _ = windows
    return fmt(pace and pace / reference, ".3f") + (f" ±{100 * error:.1f} %" if error else "")


def redis_tests(results, budget_mode):
    """Rows per redis-benchmark test and round: the calls a second full tracing counted (the
    mean of before and after the budget's run), the windows' programs counted, the
    budget's estimate, and the estimate and every window pooled over each reference."""

    def mean(before, after, i, test):
        x = [results[m][i]["tests"][test]["calls_s"] for m in (before, after)]
        return None if None in x else statistics.fmean(x)

    rows = []
    for test in REDIS_TESTS:
        for i, run in enumerate(results[budget_mode]):
            full, same = mean("every call", FULL_AFTER, i, test), mean(SAME, SAME_AFTER, i, test)
            est = run["tests"][test]["calls_s"]
            windows = run["tests"][test]["all_windows"]
            rows.append(
                {"test": test.upper(), "round": i + 1, "full tracing": fmt(full, ",.0f")}
                | {"windows' programs": fmt(same, ",.0f"), "estimated": fmt(est, ",.0f")}
                | {"estimated / full": fmt(est and full and est / full, ".3f")}
                | {"estimated / windows' programs": fmt(est and same and est / same, ".3f")}
                | {"all windows / full": _over(windows, full) if full else "-"}
                | {"all windows / windows' programs": _over(windows, same) if same else "-"}
                | {"windows": windows[2]}
            )
    return rows


def fmt(x, spec, before="", after=""):
    return "-" if x is None else f"{before}{x:{spec}}{after}"


def steps_run(exe, steps, spin, args, env):
    """The step workload under `top ARGS`: per step (rate, exact calls/s, counted or
    estimated calls/s from its seventh second to its end, error)."""
    w = subprocess.Popen(
        [exe, "steps", str(spin), *steps], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    pid = int(w.stdout.readline().split()[1])
    top = Top(pid, args, env)
    docs = [top.last]
    try:
        w.stdin.write("g")
        w.stdin.flush()
        result = json.loads(w.stdout.readline())
        while docs[-1]["time"] <= result["steps"][-1]["end"]:
            docs.append(top.doc())
    finally:
        top.stop()
        w.kill()
        w.wait()

    def counted(d):  # estimates known (a window has ended) or every call counted
        p = d["snapshot"]["processes"].get(str(pid), {})
        return "calls" in p

    out = []
    for step in result["steps"]:
        inside = [d for d in docs if step["start"] + 6 <= d["time"] <= step["end"] and counted(d)]
        exact = step["calls"] / (step["end"] - step["start"])
        if len(inside) < 2:  # a step too short to be followed
            out.append((step["rate"], exact, None, None))
            continue
        first, last = inside[0], inside[-1]
        rate = (top.mallocs(last, "malloc") - top.mallocs(first, "malloc")) / (last["time"] - first["time"])
        error = last["snapshot"]["processes"][str(pid)].get("estimate", {}).get("error")
        out.append((step["rate"], exact, rate or None, error))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--storm-batches", type=int, default=120)
    ap.add_argument("--storm-pairs", type=int, default=50_000_000, help="pairs per batch (~0.5 s untraced)")
    ap.add_argument("--requests", type=int, default=2_000_000, help="redis-benchmark -n (per test)")
    ap.add_argument(
        "--steps",
        default="1000:20,3000:20,2000:20",
        help="RATE:SECONDS,... of the step workload (the first window comes after ~5 s: 1 %% of the CPU time run pays for a 0.05 s window priced as all traps)",
    )
    ap.add_argument("--step-spin", type=int, default=330_000, help="its work a call (~100 us)")
    ap.add_argument("--workloads", default="storm,redis,steps", help="which of storm, redis, steps to run")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-budget-bench-"))
    env = private_env(tmp)
    budget_args = ["--max-overhead", str(args.budget), "--window", str(args.window)]
    heap_mode = f"heap -p budget {args.budget:g}%"
    budget_mode = f"budget {args.budget:g}%"
    modes = {"untraced": None, "always-on": ["--always-on"], budget_mode: budget_args, "every call": []}
    storm_modes = modes | {heap_mode: budget_args}
    rows = []
    try:
        switch = switch_costs(env, tmp, 5)
        heap_rows, step_rows, test_rows = [], [], []
        workloads = args.workloads.split(",")
        if "storm" in workloads:
            storm_exe = build_c(tmp, "storm", HERE / "storm.c")
            storm, control = Storm(storm_exe, env), Control(storm_exe, env)
            results = {m: [] for m in storm_modes}
            for r in range(args.rounds):
                for mode, margs in storm_modes.items():
                    # every call traced costs ~300x a pair: a 300th of the pairs
                    pairs = args.storm_pairs if mode != "every call" else args.storm_pairs // 300
                    results[mode].append(storm_round(storm, control, mode, margs, env, args.storm_batches, pairs, tmp))
                    print(f"storm round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
            storm.close()
            control.close()
            heap_runs = results.pop(heap_mode)
            rows += summarize("storm", results, "cpu_ns_pair", lambda u, f: u["calls_s"])
            heap_rows = [
                {
                    "workload": "storm",
                    "round": i + 1,
                    "speed untraced": f"{u['cpu_ns_pair']:.2f} CPU ns a pair",
                    "under heap's budget": f"{h['cpu_ns_pair']:.2f} CPU ns a pair",
                    "slowdown": f"{100 * (h['cpu_ns_pair'] / u['cpu_ns_pair'] - 1):+.2f} %",
                    "each over the control": fmt(
                        against_control(h, u) and 100 * (against_control(h, u) - 1), "+.2f", after=" %"
                    ),
                    "heap says": " / ".join(h["heap"]),
                }
                for i, (u, h) in enumerate(zip(results["untraced"], heap_runs))
            ]
        if "redis" in workloads and shutil.which("redis-server") and shutil.which("redis-benchmark"):
            port = free_port()
            server = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(tmp)],
                stdout=subprocess.DEVNULL,
                env=env,
            )
            time.sleep(1)
            # full tracing before and after the budget's run: redis-server's state drifts
            redis_modes = {m: storm_modes[m] for m in ("untraced", "always-on", "every call")}
            redis_modes |= {SAME: [], budget_mode: budget_args, SAME_AFTER: [], FULL_AFTER: [], heap_mode: budget_args}
            results = {m: [] for m in redis_modes}
            for r in range(args.rounds):
                for mode, margs in redis_modes.items():
                    n = args.requests if not mode.startswith("every call") else args.requests // 8
                    results[mode].append(redis_round(server, port, mode, margs, env, n, tmp))
                    print(f"redis round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
            server.terminate()
            server.wait(30)
            redis_heap = results.pop(heap_mode)
            rows += summarize("redis-server", results, "req_s", lambda u, f: u["req_s"] * f["calls_request"])
            test_rows = redis_tests(results, budget_mode)
            heap_rows += [
                {
                    "workload": "redis-server",
                    "round": i + 1,
                    "speed untraced": f"{u['req_s']:,.0f} req/s",
                    "under heap's budget": f"{h['req_s']:,.0f} req/s",
                    "slowdown": f"{100 * (1 - h['req_s'] / u['req_s']):+.2f} %",
                    "each over the control": "",
                    "heap says": " / ".join(h["heap"]),
                }
                for i, (u, h) in enumerate(zip(results["untraced"], redis_heap))
            ]
        if "steps" in workloads:
            steps_exe = build_c(tmp, "top_budget", ROOT / "tests/support/workloads/top_budget.c")
            steps = args.steps.split(",")
            budgeted = steps_run(steps_exe, steps, args.step_spin, budget_args, env)
            full = steps_run(steps_exe, steps, args.step_spin, [], env)
            step_rows = [
                {"step (mallocs/s)": r, "exact (workload) budget run": f"{x:,.0f}", "estimated": fmt(e, ",.0f")}
                | {
                    "estimated / exact": fmt(e and e / x, ".3f"),
                    "error (95%)": fmt(err and 100 * err, ".1f", "±", " %"),
                }
                | {"exact (workload) full run": f"{fx:,.0f}", "full tracing counted": fmt(fc, ",.0f")}
                | {"estimated / full tracing": fmt(e and fc and e / fc, ".3f")}
                for (r, x, e, err), (_, fx, fc, _) in zip(budgeted, full)
            ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, budget {args.budget:g}%, window {args.window:g} s")
    print(f"load at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)\n")
    print_table(
        [
            {"probes": w, "attach CPU ms": round(a, 2), "attach wall ms": round(b, 1)}
            | {"detach CPU ms": round(c, 2), "detach wall ms": round(d, 1)}
            for w, a, b, c, d in switch
        ],
        markdown=args.markdown,
    )
    print()
    print_table(rows, markdown=args.markdown)
    if test_rows:
        print("\nredis-server, each test apart (calls a second):\n")
        print_table(test_rows, markdown=args.markdown)
    print()
    print_table(step_rows, markdown=args.markdown)
    print("\nThe storm and redis-server under `heap -p PID --max-overhead` (same rounds):\n")
    print_table(heap_rows, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
