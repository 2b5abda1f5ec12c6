#!/usr/bin/env python3
"""CPU time of one BCC compile per module variant (not a test): what each command's module
costs with and without the programs it may leave out (issue 10, item 16).

Each measurement is a fresh process (BCC caches nothing across processes) compiling one
module with pymtrace.bpf.load.load_parts and reporting the compiling thread's CPU time,
which the machine's load inflates far less than wall time. Rounds are interleaved; the
1-minute load average of each run is kept. Usage: sudo bench/compile_cpu.py [--rounds 5]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# variant -> [(program, defines)]: top's and the exporter's module (malloc_stats + faults +
# slab), with and without the other allocators' programs; record's, with and without the
# interposer's entry programs
VARIANTS = {
    "top: malloc_stats (libc + other allocators) + faults + slab": [
        ("malloc_stats", {"MS_GLIBC": 1, "MS_FOREIGN": 1}),
        ("faults", {}),
        ("slab", {}),
    ],
    "top: malloc_stats (libc only) + faults + slab": [
        ("malloc_stats", {"MS_GLIBC": 1, "MS_FOREIGN": 0}),
        ("faults", {}),
        ("slab", {}),
    ],
    "top --always-on: faults + slab": [("faults", {}), ("slab", {})],
    "record (with interposer programs)": [("record", {"OUTER_PROBES": 1})],
    "record (without)": [("record", {"OUTER_PROBES": 0})],
}

CHILD = """
import json, sys, time
from pymtrace.bpf import load
parts = [load.Part(p, d) for p, d in json.loads(sys.argv[1])]
cpu = time.thread_time()
bpf = load.load_parts(parts)
cpu = time.thread_time() - cpu
print(json.dumps([cpu, len(load.program_names(bpf))]))
load.detach_all(bpf)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (BCC compiles and loads the programs)")
    results = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            load = os.getloadavg()[0]
            out = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(VARIANTS[v])],
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                capture_output=True,
                text=True,
                check=True,
            )
            cpu, programs = json.loads(out.stdout.splitlines()[-1])
            results[v].append((cpu, load, programs))
            print(f"round {r + 1} {v:60} {cpu:5.2f} CPU-s  {programs:2} programs  load {load:.1f}", file=sys.stderr)
    print("| module | programs | compile CPU min / median (s) | load (1-min avg) |")
    print("|---|---|---|---|")
    for v, res in results.items():
        cpus, loads = [x[0] for x in res], [x[1] for x in res]
        print(
            f"| {v} | {res[0][2]} | {min(cpus):.2f} / {statistics.median(cpus):.2f} | "
            f"{min(loads):.1f}-{max(loads):.1f} |"
        )


if __name__ == "__main__":
    main()
