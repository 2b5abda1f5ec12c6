#!/usr/bin/env python3
"""Benchmark of the overhead budget (`pymtrace top -p PID --max-overhead PCT`; not a test).

    sudo /opt/pymtrace/venv/bin/python bench/budget_bench.py [--rounds 2] [--budget 1] [--markdown]

1. Attach/detach: the CPU and wall time of attaching and detaching top's malloc probe set
   for one process (what every window pays), as uprobe_multi links and as perf-event
   uprobes (PYMTRACE_FAKE_NO_UPROBE_MULTI: the way of kernels without links, Debian 12's 6.1).
2. The storm (bench/storm.c: malloc(64)+free pairs, one thread, CPU-bound) and redis-server
   (jemalloc) under `redis-benchmark -t set,lpush -d 200 -r 1000000 -c 10`, each untraced,
   under `top -p PID --max-overhead PCT`, and under `top -p PID` (every call), in
   interleaved rounds: the traced process's slowdown (storm: its ns and CPU ns per pair;
   redis: requests/s) against the untraced runs of the same round, and the malloc-API calls
   top estimated under the budget against the exact count (storm: the pairs it made;
   redis: calls per request as `top -p` counted them, times the requests made).

Every process runs on a private copy of the system libc named libc.so.6 (LD_LIBRARY_PATH;
redis-server's jemalloc is its own file): uprobes are per file, and other tools on a shared
machine probing the system libc would slow every process down. Only ratios inside one run
mean anything: the machine is shared and noisy.
"""

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchutil import build_c, print_table  # noqa: E402

from pymtrace.bpf import uprobes  # noqa: E402
from pymtrace.sources.base import attach_plan  # noqa: E402
from pymtrace.sources.malloc import MallocSource  # noqa: E402
from pymtrace.tracee import libc  # noqa: E402

PY = [sys.executable, "-m", "pymtrace"]


def private_env(tmp):
    shutil.copy2(libc.system_libc(), tmp / "libc.so.6")
    return dict(os.environ, LD_LIBRARY_PATH=str(tmp), PYTHONPATH=str(ROOT))


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Top:
    """`pymtrace top --json -p PID ARGS` running, its documents read on demand."""

    def __init__(self, pid, args, env):
        self.proc = subprocess.Popen(
            PY + ["top", "--json", "-i", "1", "--no-glibc", "--view", "processes", "-p", str(pid), *args],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = pid
        self.last = self.doc()

    def doc(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("top ended early")
        return json.loads(line)

    def after(self, t):
        while True:
            d = self.doc()
            if d["time"] > t:
                self.last = d
                return d

    def mallocs(self, d):
        return sum(v for k, v in d["snapshot"]["processes"][str(self.pid)].get("calls", {}).items())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


class _Probed(MallocSource):
    """top's malloc source, keeping what its attach added (for uprobes.release)."""

    handles = []

    def _attach_libc(self, path, pid, plan):
        self.attached += attach_plan(self.bpf, path, pid, plan, handles=self.handles)


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


def storm_round(storm, pid, mode, args, env, batches, pairs):
    top = Top(pid, args, env) if mode != "untraced" else None
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    ns = []
    for _ in range(batches):
        storm.stdin.write(f"{pairs} 64\n")
        storm.stdin.flush()
        ns.append(float(storm.stdout.readline()))
    cpu = (cpu_seconds(pid) - cpu0) / (batches * (pairs + 1000)) * 1e9
    res = {"ns_pair": statistics.median(ns), "cpu_ns_pair": cpu, "seconds": time.monotonic() - t0}
    if top:
        d = top.after(time.monotonic())
        res["calls"] = top.mallocs(d)
        res["exact"] = 2 * batches * (pairs + 1000)
        res["budget"] = d["snapshot"].get("budget")
        res["error"] = d["snapshot"]["processes"][str(pid)].get("estimate", {}).get("error")
        top.stop()
    return res


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_round(server, port, mode, args, env, requests):
    top = Top(server.pid, args, env) if mode != "untraced" else None
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-t", "set,lpush", "-d", "200", "-r", "1000000", "-c", "10"]
        + ["-n", str(requests), "-q", "--csv"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rates = [float(line.split(",")[1].strip('"')) for line in out.splitlines()[1:] if line.strip()]
    res = {"req_s": statistics.fmean(rates), "requests": requests * len(rates)}
    if top:
        d = top.after(time.monotonic())
        res["calls"] = top.mallocs(d)
        res["budget"] = d["snapshot"].get("budget")
        res["error"] = d["snapshot"]["processes"][str(server.pid)].get("estimate", {}).get("error")
        top.stop()
    return res


def summarize(name, results, speed):
    """Rows: per mode the median speed (SPEED key) and its slowdown against the untraced runs
    of the same round, the calls counted or estimated per unit of work."""
    rows = []
    for mode, runs in results.items():
        ratios = [r[speed] / u[speed] for r, u in zip(runs, results["untraced"])]
        row = {"workload": name, "mode": mode, "speed": f"{statistics.median(r[speed] for r in runs):.1f} {speed}"}
        row |= dict.fromkeys(("vs untraced", "calls per unit", "measured overhead %", "duty cycle", "windows"), "")
        row["error (95%)"] = ""
        row["vs untraced"] = f"{statistics.median(ratios):.3f}x"
        if "calls" in runs[0]:
            per = [r["calls"] / r.get("exact", r.get("requests")) for r in runs]
            row["calls per unit"] = round(statistics.median(per), 3)
            b = runs[-1]["budget"]
            if b:
                row["measured overhead %"] = round(b["overhead_pct"] or 0, 3)
                row["duty cycle"] = round(b["duty_cycle"], 4)
                row["windows"] = b["windows"]
                row["error (95%)"] = runs[-1]["error"]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--storm-batches", type=int, default=20)
    ap.add_argument("--storm-pairs", type=int, default=50_000_000, help="pairs per batch (~0.5 s untraced)")
    ap.add_argument("--requests", type=int, default=200_000, help="redis-benchmark -n (per test)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-budget-bench-"))
    env = private_env(tmp)
    budget_args = ["--max-overhead", str(args.budget), "--window", str(args.window)]
    modes = {"untraced": None, f"budget {args.budget:g}%": budget_args, "every call": []}
    rows = []
    try:
        switch = switch_costs(env, tmp, 5)
        storm_exe = build_c(tmp, "storm", HERE / "storm.c")
        storm = subprocess.Popen([storm_exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        pid = int(storm.stdout.readline().split()[1])
        results = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode, margs in modes.items():
                # every call traced costs ~300x a pair: a 300th of the pairs
                pairs = args.storm_pairs if mode != "every call" else args.storm_pairs // 300
                results[mode].append(storm_round(storm, pid, mode, margs, env, args.storm_batches, pairs))
                print(f"storm round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
        storm.stdin.close()
        storm.wait()
        rows += summarize("storm", results, "ns_pair")
        if shutil.which("redis-server") and shutil.which("redis-benchmark"):
            port = free_port()
            server = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(tmp)],
                stdout=subprocess.DEVNULL,
                env=env,
            )
            time.sleep(1)
            results = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode, margs in modes.items():
                    n = args.requests if mode != "every call" else args.requests // 8
                    results[mode].append(redis_round(server, port, mode, margs, env, n))
                    print(f"redis round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
            server.terminate()
            server.wait(30)
            rows += summarize("redis-server", results, "req_s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, budget {args.budget:g}%, window {args.window:g} s\n")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
