#!/usr/bin/env python3
"""Benchmark of the two ways analyze's report can pair events and sum live bytes on DuckDB (not
a test; no root needed): the measurement that chose analyze's engine (trace/report_sql.py).

`analyze`: `pymtrace analyze --json` (TraceSet: DuckDB sorts, numpy pairs the sorted stream);
`windows`: the same report with the steps Spark runs (SparkEngine's pair, live and percentiles:
window functions, percentile_disc) on TraceSet's DuckDB. Both run in a child process over the
same synthetic Parquet trace (tests/support/synthetic.py, --events rows) with the same DuckDB
memory limit, threads and spill directory. Reported per run: wall time, CPU time (user +
system of the child and its DuckDB threads) and peak RSS of the child (/usr/bin/time), and
whether the numbers equal the trace's ground truth. Interleaved rounds.
Usage: bench/analyze_engines.py [--events N] [--memory-limit SIZE ...] [--threads N] [--rounds R]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchutil import print_table  # noqa: E402

ENGINES = ("analyze", "windows")


def windows_child(directory, memory_limit, threads, temp_dir):
    """The `windows` engine, in this (child) process: TraceSet with Spark's steps."""
    from pymtrace.trace.analysis import TraceSet
    from pymtrace.trace.report_sql import SparkEngine

    class Windows(TraceSet):
        pair, live, percentiles = SparkEngine.pair, SparkEngine.live, SparkEngine.percentiles

    with Windows([directory], memory_limit=memory_limit, threads=threads or None, temp_dir=temp_dir) as ts:
        json.dump(ts.report().to_json(), sys.stdout)


def run_engine(engine, directory, memory_limit, threads, tmp):
    """(report or None, wall s, CPU s, peak RSS MB, error line) of ENGINE in a child process."""
    spill = tempfile.mkdtemp(prefix="spill.", dir=tmp)
    if engine == "analyze":
        cmd = [sys.executable, "-m", "pymtrace", "analyze", "--json", directory]
        cmd += ["--memory-limit", memory_limit, "--temp-dir", spill] + (["--threads", str(threads)] if threads else [])
    else:
        cmd = [sys.executable, __file__, "--child", directory, memory_limit, str(threads or 0), spill]
    out, usage = os.path.join(tmp, "out.json"), os.path.join(tmp, "usage")
    # /usr/bin/time measures the child: a child forked from this process would count this
    # process's own peak RSS (the trace's generation) in its own (the kernel keeps it over exec)
    cmd = ["/usr/bin/time", "-f", "%e %U %S %M", "-o", usage, *cmd]
    with open(out, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    shutil.rmtree(spill, ignore_errors=True)
    with open(usage) as f:
        wall, user, system, rss_kb = f.read().split()[-4:]
    cost = float(wall), float(user) + float(system), int(rss_kb) / 1024
    if proc.returncode != 0:
        lines = proc.stderr.decode().strip().splitlines() or [f"exit status {proc.returncode}"]
        return (None, *cost, lines[-1])
    with open(out) as f:
        return (json.load(f), *cost, "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=5_000_000, help="rows of the synthetic trace (default 5M)")
    ap.add_argument("--memory-limit", action="append", help="DuckDB memory limits (default 1GB and 256MB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engine", action="append", choices=ENGINES, help="default: both")
    ap.add_argument("--temp-dir", help="where the trace and the spill go (default $TMPDIR)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        directory, limit, threads, spill = args.child
        return windows_child(directory, limit, int(threads), spill)
    from support import synthetic

    tmp = tempfile.mkdtemp(prefix="analyze-engines.", dir=args.temp_dir)
    rows = []
    try:
        slots = 1000
        steps = (args.events + slots) // 2  # each step an allocation and (after the first slots) a free
        directory = os.path.join(tmp, "trace")
        os.mkdir(directory)
        t0 = time.monotonic()
        n = synthetic.write(os.path.join(directory, "synthetic.parquet"), steps, slots, 4)
        print(f"{n} events generated in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        truth = synthetic.truth(steps, slots, 4)
        for r in range(args.rounds):
            for limit in args.memory_limit or ["1GB", "256MB"]:
                engines = list(args.engine or ENGINES)
                for engine in engines if r % 2 == 0 else reversed(engines):
                    rep, wall, cpu, rss, err = run_engine(engine, directory, limit, args.threads, tmp)
                    row = {
                        "engine": engine,
                        "events": n,
                        "memory limit": limit,
                        "threads": args.threads,
                        "wall s": round(wall, 1),
                        "CPU s": round(cpu, 1),
                        "peak RSS MB": round(rss),
                        "exact": synthetic.agrees(rep, truth),
                        "error": err[:120],
                    }
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
