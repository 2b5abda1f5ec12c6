#!/usr/bin/env python3
"""Benchmark of `pymtrace analyze` on large synthetic traces (not a test; no root needed).

For each size in --events (default 10M and 50M events), a synthetic Parquet trace is generated
(tests/support/synthetic.py: malloc-family calls and frees over 1000 live slots, 4 threads,
with exact ground truth computed independently), then `pymtrace analyze --json` runs on it in a
child process under --memory-limit; reported: the analysis's CPU time (user + system, all
DuckDB threads: wall time on the shared machine means little), wall time, CPU per 10M events,
the child's peak RSS, the trace's size, and whether every checked number matched the truth.
Usage: bench/analyze_bench.py [--events N ...] [--memory-limit SIZE] [--threads N] [--markdown]
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchutil import print_table  # noqa: E402
from support import synthetic  # noqa: E402


def run_one(events, memory_limit, threads, tmp):
    steps = (events + synthetic_slots) // 2  # each step one allocation and (after the first slots) one free
    path = os.path.join(tmp, f"synthetic-{events}.parquet")
    t0 = time.monotonic()
    rows = synthetic.write(path, steps, synthetic_slots, 4)
    gen_s = time.monotonic() - t0
    truth = synthetic.truth(steps, synthetic_slots, 4)
    cmd = [
        sys.executable,
        "-m",
        "pymtrace",
        "analyze",
        "--json",
        path,
        "--memory-limit",
        memory_limit,
        "--temp-dir",
        tmp,
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    rep = json.loads(proc.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    exact = synthetic.agrees(rep, truth)
    result = {
        "events": rows,
        "parquet MB": round(os.path.getsize(path) / 1e6, 1),
        "generated in s": round(gen_s, 1),
        "memory limit": memory_limit,
        "analysis CPU s": round(cpu, 1),
        "wall s": round(wall, 1),
        "CPU s per 10M events": round(cpu * 1e7 / rows, 1),
        "peak RSS MB": round(
            after.ru_maxrss / 1024, 0
        ),  # the largest child so far: run one size per process to be sure
        "exact": exact,
    }
    os.unlink(path)
    return result


synthetic_slots = 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, action="append", help="trace sizes (default 10M and 50M)")
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--temp-dir", help="where the trace and the spill go (default $TMPDIR)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="analyze-bench.", dir=args.temp_dir)
    try:
        rows = [run_one(n, args.memory_limit, args.threads, tmp) for n in args.events or [10_000_000, 50_000_000]]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
