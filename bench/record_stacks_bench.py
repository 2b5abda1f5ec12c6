#!/usr/bin/env python3
"""Benchmark of `pymtrace record --stacks` against `pymtrace record` (not a timed test).

The single-thread malloc(64)+free storm (storm.c `once N`, built -O2 -fomit-frame-pointer),
untraced, recorded and recorded with --stacks, interleaved in every round. Per configuration:
  - the storm's own CPU time per call (CLOCK_PROCESS_CPUTIME_ID: user + the uprobe traps' kernel
    time), minimum and median over rounds; the cost of --stacks = the difference per allocation
  - pymtrace's CPU per event (drain + write) and, with --stacks, the unwinder's CPU per stack
  - records lost (must be 0) and allocations left without a stack (id 0: the stack ring was full
    while the unwinder fell behind), distinct stacks
Usage: sudo bench/record_stacks_bench.py [--pairs N] [--rounds R] [--buffer-size 32M] [--markdown]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchutil import build_c, print_table

SRC = pathlib.Path(__file__).resolve().parent / "storm.c"


def cpu_ns(out):
    """The storm's CPU ns per malloc+free pair."""
    for line in out.splitlines():
        if line.startswith("pairs "):
            return float(line.split()[5])
    raise RuntimeError(f"no result from the storm: {out!r}")


def run(exe, pairs, tmp, buffer_size, mode):
    cmd = [exe, "once", str(pairs)]
    if mode == "untraced":
        return cpu_ns(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout), {}
    out = os.path.join(tmp, f"trace.{len(os.listdir(tmp))}")
    extra = ["--stacks"] if mode == "record --stacks" else []
    proc = subprocess.run(
        [sys.executable, "-m", "pymtrace", "record", "--json", "--allow-drops", "--buffer-size", buffer_size]
        + extra
        + ["-o", out, "--", *cmd],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    for path in (out, out + ".stacks"):
        if os.path.exists(path):
            os.unlink(path)
    return cpu_ns(proc.stdout), json.loads(proc.stderr.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--buffer-size", default="32M")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    modes = ("untraced", "record", "record --stacks")
    results = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_c(tmp, "record_storm", SRC, flags=["-O2", "-fno-builtin", "-fomit-frame-pointer"])
        for _ in range(args.rounds):  # interleaved: each configuration once a round
            for m in modes:
                results[m].append(run(exe, args.pairs, tmp, args.buffer_size, m))
    rows = []
    for m in modes:
        rec = results[m]
        ns = [r[0] / 2 for r in rec]  # per call: half a pair
        row = {
            "mode": m,
            "pairs": args.pairs,
            "rounds": args.rounds,
            "cpu_ns_per_call_min": round(min(ns), 1),
            "cpu_ns_per_call_median": round(statistics.median(ns), 1),
        }
        if m != "untraced":
            s = [r[1] for r in rec]
            row["consumer_us_per_event"] = round(
                statistics.median(x["consumer_cpu_s"] / max(1, x["entries"]) * 1e6 for x in s), 3
            )
            row["records_lost_max"] = max(x["lost"] for x in s)
            if "stacks" in s[0]:
                allocs = [sum(f["counts"].get("malloc", 0) for f in x["files"]) for x in s]
                row["unwinder_us_per_stack"] = round(
                    statistics.median(
                        x["unwinder_cpu_s"] / max(1, a - x["stacks_lost"]) * 1e6 for x, a in zip(s, allocs)
                    ),
                    2,
                )
                row["allocs_without_stack_median"] = int(statistics.median(x["stacks_lost"] for x in s))
                row["allocs"] = allocs[0]
                row["distinct_stacks"] = max(x["stacks"] for x in s)
        rows.append(row)
    base = rows[1]["cpu_ns_per_call_min"]
    for r in rows[2:]:
        r["stacks_extra_ns_per_alloc_min"] = round(2 * (r["cpu_ns_per_call_min"] - base), 1)
        r["stacks_extra_ns_per_alloc_median"] = round(
            2 * (r["cpu_ns_per_call_median"] - rows[1]["cpu_ns_per_call_median"]), 1
        )
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print_table([{k: r.get(k) for k in keys} for r in rows], args.markdown)


if __name__ == "__main__":
    main()
