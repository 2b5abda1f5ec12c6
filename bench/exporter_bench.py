#!/usr/bin/env python3
"""Benchmark of `pymtrace exporter` (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/exporter_bench.py [--rounds 7] [--pairs 300000]

1. Traced-workload slowdown: two single-thread workloads on a private copy of the system
   libc (which the exporter's system-wide probes attach to, but tracers other users of the
   machine put on the system libc do not): bench/storm.c (malloc(64)+free pairs: the
   uprobes of --per-call) and its page-touching loop (`storm touch`: malloc(256 KiB), touch
   every page, free: mmap, 64 page faults, munmap: what the default mode traces), measured in
   phases: untraced, exporter --always-on, exporter --per-call, untraced again. Min and
   median ns per operation, and the slowdown of the median against untraced (both
   untraced phases pooled).
3. The default mode (malloc's uprobes in windows under a 1 % budget) on a busy host: the
   storm runs continuously (batches of --budget-pairs) for --budget-seconds untraced, under
   the default exporter and untraced again; its mean CPU ns per pair over each phase (a
   window slows the batches it falls in: the mean, not the median, carries its cost),
   and the last scrape's budget gauges (windows, duty cycle, measured overhead) and the
   storm's estimated call rate against the rate its own batches ran at under the budget.
2. Scrape cost: with the --per-call exporter running and N idle processes with distinct
   comms (each made a known malloc), scrape /metrics once a second; report the number of
   series, scrape latency (client side: median, p90, max) and the exporter's CPU seconds
   per wall second (/proc/PID/stat utime+stime of all its threads), idle and while scraped.

The machine is shared and noisy: only ratios inside one run mean anything. Prints a
markdown table for docs/exporter.md; --json FILE also writes the raw numbers.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchutil import build_c, cpu_seconds, uprobe_pids

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # this tree's pymtrace (its libc helpers), as the exporter it runs
PY = [sys.executable, "-m", "pymtrace"]

IDLE_C = r"""
/* Fork N idle processes named <prefix><i>; each mallocs 100 bytes once and waits for
 * stdin of the parent to close. Prints "ready" when all exist. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    int n = atoi(argv[1]);
    int fds[2];
    if (pipe(fds)) return 1;
    for (int i = 0; i < n; i++) {
        if (fork() == 0) {
            char name[16], c;
            close(fds[1]);
            snprintf(name, sizeof name, "%s%d", argv[2], i);
            prctl(PR_SET_NAME, name);
            void *volatile p = malloc(100);
            (void)p;
            while (read(fds[0], &c, 1) > 0) ;
            _exit(0);
        }
    }
    close(fds[0]);
    printf("ready\n");
    fflush(stdout);
    char line[8];
    while (fgets(line, sizeof line, stdin)) ;
    close(fds[1]);
    while (wait(0) > 0) ;
    return 0;
}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    def __init__(self, *args):
        self.port = free_port()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            PY + ["exporter", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        while True:
            line = self.proc.stderr.readline()
            if "serving" in line:
                break
            if not line:
                raise SystemExit(f"exporter failed to start: {self.proc.stderr.read()}")
        self.startup = time.monotonic() - t0
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def cpu_seconds(self):
        return cpu_seconds(self.proc.pid)

    def scrape(self):
        t0 = time.perf_counter()
        with urllib.request.urlopen(self.url, timeout=60) as r:
            body = r.read()
        return time.perf_counter() - t0, body.decode()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Storm:
    """The storm on a private copy of the system libc (tmp/libc.so.6 via LD_LIBRARY_PATH):
    uprobes belong to a file, so tracers that other users of the machine attached to the
    system libc do not slow it down, while the exporter (which attaches to every libc a
    running process maps) does probe it. A measurement during which any process but the
    exporter had uprobes on the copy (bpftool perf list) is discarded and repeated."""

    def __init__(self, argv, tmp, pairs, size):
        from pymtrace.tracee import libc

        self.pairs, self.size = pairs, size
        self.libc = os.path.join(tmp, "libc.so.6")
        if not os.path.exists(self.libc):
            shutil.copy2(libc.system_libc(), self.libc)
        env = dict(os.environ, LD_LIBRARY_PATH=tmp)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().startswith("ready")
        if not any(m.path == self.libc for m in libc.read_maps(self.proc.pid)):
            raise SystemExit("the storm did not load the private libc copy")
        self.allowed = set()
        self.discarded = 0

    def foreign(self):
        return (uprobe_pids(self.libc) or set()) - self.allowed

    def run(self):
        for _ in range(6):
            before = self.foreign()
            self.proc.stdin.write(f"{self.pairs} {self.size}\n")
            self.proc.stdin.flush()
            ns = float(self.proc.stdout.readline())
            if not before and not self.foreign():
                return ns
            self.discarded += 1
            time.sleep(1)
        return ns

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def continuous(storm, seconds):
    """Batches of the storm for SECONDS: (CPU ns per pair over them all, wall ns per pair
    over them all, pairs)."""
    from pymtrace.tracee import proc

    pid = storm.proc.pid
    cpu0, t0, pairs = proc.cpu_ns(pid), time.monotonic_ns(), 0
    while time.monotonic_ns() - t0 < seconds * 1e9:
        storm.proc.stdin.write(f"{storm.pairs} {storm.size}\n")
        storm.proc.stdin.flush()
        storm.proc.stdout.readline()
        pairs += storm.pairs
    return (proc.cpu_ns(pid) - cpu0) / pairs, (time.monotonic_ns() - t0) / pairs, pairs


def sample(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def budget_phase(storm_bin, tmp, pairs, seconds):
    """The storm untraced, under the default exporter (budget) and untraced again."""
    storm = Storm([storm_bin], tmp, pairs, 64)
    out = {"untraced": [continuous(storm, seconds)]}
    print("exporter default (budget): starting ...", file=sys.stderr)
    ex = Exporter("--comm", "^storm$")
    storm.allowed = {ex.proc.pid}
    try:
        out["startup"] = ex.startup
        ex.scrape()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        first = continuous(storm, seconds / 2)
        _, text0 = ex.scrape()
        t_mid = time.monotonic()
        second = continuous(storm, seconds / 2)
        _, text = ex.scrape()
        t1 = time.monotonic()
        out["exporter_cpu_per_s"] = (ex.cpu_seconds() - cpu0) / (t1 - t0)
        n = first[2] + second[2]
        out["budget"] = (
            (first[0] * first[2] + second[0] * second[2]) / n,
            (first[1] * first[2] + second[1] * second[2]) / n,
            n,
        )
    finally:
        ex.stop()
    out["untraced"].append(continuous(storm, seconds))
    storm.close()
    out["scrape"] = {
        name: sample(text, name)
        for name in (
            "pymtrace_exporter_sampling_windows_total",
            "pymtrace_exporter_duty_cycle",
            "pymtrace_exporter_overhead_ratio",
            "pymtrace_exporter_overhead_budget_ratio",
        )
    }
    calls = [
        sum(sample(t, "pymtrace_malloc_calls_estimated_total", comm="storm", call=c) or 0 for c in ("malloc", "free"))
        for t in (text0, text)
    ]
    out["scrape"]["calls_per_second"] = (calls[1] - calls[0]) / (t1 - t_mid)
    out["scrape"]["error"] = sample(text, "pymtrace_malloc_estimate_error_ratio", comm="storm")
    out["scrape"]["saturated"] = sample(text, "pymtrace_malloc_estimate_saturated_processes", comm="storm")
    return out


def measure(storms, rounds):
    """{workload: [ns per op]}, the workloads interleaved round by round."""
    out = {name: [] for name in storms}
    for _ in range(rounds):
        for name, storm in storms.items():
            out[name].append(storm.run())
    return out


def series_count(text, prefix=None):
    return sum(
        1
        for line in text.splitlines()
        if line and not line.startswith("#") and (prefix is None or line.startswith(prefix))
    )


def scrape_phase(ex, n_scrapes, interval=1.0):
    lat = []
    cpu0, t0 = ex.cpu_seconds(), time.monotonic()
    text = ""
    for _ in range(n_scrapes):
        start = time.monotonic()
        dt, text = ex.scrape()
        lat.append(dt)
        time.sleep(max(0.0, interval - (time.monotonic() - start)))
    cpu = (ex.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    return lat, cpu, text


def idle_cpu(ex, seconds):
    cpu0, t0 = ex.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    return (ex.cpu_seconds() - cpu0) / (time.monotonic() - t0)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="storm measurements per phase")
    ap.add_argument("--pairs", type=int, default=300000, help="malloc+free pairs per measurement")
    ap.add_argument("--scrapes", type=int, default=30, help="scrapes per scrape phase (1/s)")
    ap.add_argument("--procs", default="37,1000", help="idle processes (distinct comms) per scrape phase")
    ap.add_argument("--budget-seconds", type=float, default=60, help="each phase of the default mode's test")
    ap.add_argument("--budget-pairs", type=int, default=20_000_000, help="storm pairs per batch there")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    tmp = tempfile.mkdtemp(prefix="pymtrace-exporter-bench-")
    try:
        storm_bin = build_c(tmp, "storm", src_path=HERE / "storm.c")
        idle_bin = build_c(tmp, "idle", source=IDLE_C)
        touch_bin = build_c(tmp, "touch", src_path=HERE / "storm.c")  # its own name: comm "touch", as before
        storms = {
            "malloc(64)+free": Storm([storm_bin], tmp, args.pairs, 64),
            "malloc(256 KiB)+touch+free": Storm([touch_bin, "touch"], tmp, max(1, args.pairs // 100), 256 << 10),
        }
        res = {"pairs": args.pairs, "rounds": args.rounds, "phases": {}, "scrape": []}
        print("untraced ...", file=sys.stderr)
        res["phases"]["untraced-1"] = measure(storms, args.rounds)
        for mode, flags in (("always-on", ["--always-on"]), ("per-call", ["--per-call"])):
            print(f"exporter {mode}: starting ...", file=sys.stderr)
            ex = Exporter(*flags, "--comm", "^pmxbench")
            for st in storms.values():
                st.allowed = {ex.proc.pid}
            res.setdefault("startup", {})[mode] = ex.startup
            try:
                ex.scrape()
                res["phases"][mode] = measure(storms, args.rounds)
                if mode == "per-call":
                    res["idle_cpu"] = idle_cpu(ex, 10)
                    for n in [int(x) for x in args.procs.split(",") if x]:
                        print(f"scrape phase with {n} processes ...", file=sys.stderr)
                        idle = subprocess.Popen(
                            [idle_bin, str(n), "pmxbench"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                        )
                        assert idle.stdout.readline().strip() == "ready"
                        time.sleep(2)
                        ex.scrape()
                        lat, cpu, text = scrape_phase(ex, args.scrapes)
                        idle.stdin.close()
                        idle.wait()
                        res["scrape"].append(
                            {
                                "processes": n,
                                "series": series_count(text),
                                "workload_series": series_count(text, "pymtrace_malloc")
                                + series_count(text, "pymtrace_page"),
                                "bytes": len(text),
                                "latency_median": statistics.median(lat),
                                "latency_p90": pct(lat, 0.9),
                                "latency_max": max(lat),
                                "cpu_per_s": cpu,
                            }
                        )
            finally:
                ex.stop()
                for st in storms.values():
                    st.allowed = set()
        print("untraced again ...", file=sys.stderr)
        res["phases"]["untraced-2"] = measure(storms, args.rounds)
        res["discarded"] = sum(st.discarded for st in storms.values())
        for st in storms.values():
            st.close()
        res["budget"] = budget_phase(storm_bin, tmp, args.budget_pairs, args.budget_seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\n{args.rounds} measurements per phase and workload, workloads interleaved; "
        f"{res['discarded']} disturbed measurements discarded and repeated\n"
    )
    print("| workload | mode | ns/op min | ns/op median | slowdown (median) |")
    print("|---|---|---|---|---|")
    for wl in storms:
        base = res["phases"]["untraced-1"][wl] + res["phases"]["untraced-2"][wl]
        bmed = statistics.median(base)
        for name, vals in (
            ("untraced", base),
            ("exporter --always-on", res["phases"]["always-on"][wl]),
            ("exporter --per-call", res["phases"]["per-call"][wl]),
        ):
            med = statistics.median(vals)
            print(f"| {wl} | {name} | {min(vals):.0f} | {med:.0f} | {100 * (med / bmed - 1):+.1f} % |")
    print(
        f"\nExporter start-up (compile + attach): --always-on {res['startup']['always-on']:.1f} s, "
        f"--per-call {res['startup']['per-call']:.1f} s; idle CPU (--per-call, no scrapes): {res['idle_cpu']:.3f} s/s\n"
    )
    print(
        "| idle processes | series in a scrape | of them per-process | scrape bytes | latency median | p90 | max | exporter CPU s/s at 1 scrape/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in res["scrape"]:
        print(
            f"| {s['processes']} | {s['series']} | {s['workload_series']} | {s['bytes']} | "
            f"{1000 * s['latency_median']:.0f} ms | {1000 * s['latency_p90']:.0f} ms | "
            f"{1000 * s['latency_max']:.0f} ms | {s['cpu_per_s']:.3f} |"
        )
    b = res["budget"]
    base = statistics.fmean(u[0] for u in b["untraced"])
    sc = b["scrape"]
    print(
        f"\nDefault mode (budget), the storm running {args.budget_seconds:g} s a phase: CPU ns per pair "
        f"untraced {' / '.join(f'{u[0]:.2f}' for u in b['untraced'])}, under the budget {b['budget'][0]:.2f} "
        f"({100 * (b['budget'][0] / base - 1):+.2f} %); exporter CPU {b['exporter_cpu_per_s']:.3f} s/s; "
        f"start-up {b['startup']:.1f} s"
    )
    print(
        f"Its scrape: windows {sc['pymtrace_exporter_sampling_windows_total']}, duty cycle "
        f"{sc['pymtrace_exporter_duty_cycle']}, measured overhead {sc['pymtrace_exporter_overhead_ratio']} "
        f"(budget {sc['pymtrace_exporter_overhead_budget_ratio']}), storm estimated {sc['calls_per_second']:,.0f} "
        f"calls/s over the second half (error {sc['error']}, saturated {sc['saturated']}); it ran {2e9 / b['budget'][1]:,.0f} calls/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
