#!/usr/bin/env python3
"""CPU time of one BCC compile per module variant (not a test): what each command's module
costs with and without the programs it may leave out.

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

# the programs a command selects (allocators.programs; jemalloc 5.3's layouts, as measured)
_CXX = ["ms_f_new_s1", "ms_f_new_array_s1", "ms_f_new_nothrow_s1", "ms_f_new_aligned_s1", "ms_f_delete_p1",
        "ms_f_delete_array_p1", "ms_f_delete_sized_p1", "ms_f_delete_aligned_p1"]  # fmt: skip
_JEMALLOC = ["ms_f_malloc_s1", "ms_f_calloc_n1s2", "ms_f_realloc_p1s2", "ms_f_realloc_x", "ms_f_free_p1",
             "ms_f_memalign_s2", "ms_f_posix_memalign_p1s3", "ms_f_valloc_s1"]  # fmt: skip


def _want(prefix, programs, rename=lambda p: p):
    return {prefix + "SELECT": 1, **{f"{'MS_' if prefix == 'MS_F_' else ''}WANT_{rename(p)}": 1 for p in programs}}


def _ms(glibc, foreign, cxx, programs=None):
    d = {"MS_GLIBC": glibc, "MS_FOREIGN": foreign, "MS_CXX": cxx}
    return d if programs is None else {**d, **_want("MS_F_", programs)}


def _rec(programs=None, libc=1):
    d = {"OUTER_PROBES": 0, "LIBC_PROBES": libc, "GLIBC_CHUNKS": libc}
    if programs is None:
        return d
    return {**d, **_want("F_", programs, lambda p: "enter_f_" + p.removeprefix("ms_f_"))}


_TOP = [("faults", {}), ("slab", {})]
# variant -> [(program, defines)]: top's and the exporter's module (malloc_stats + faults +
# slab) as each program selection compiles it; record's for a glibc process and a jemalloc one
VARIANTS = {
    "top, before: libc + every other allocator's and C++'s program": [("malloc_stats", _ms(1, 1, 1))] + _TOP,
    "top, libc only (before and now, no C++ mapped)": [("malloc_stats", _ms(1, 0, 0))] + _TOP,
    "top, now: libc + C++ (a libstdc++ mapped)": [("malloc_stats", _ms(1, 0, 1, _CXX))] + _TOP,
    "top, now: libc + C++ + jemalloc's layouts": [("malloc_stats", _ms(1, 1, 1, _CXX + _JEMALLOC))] + _TOP,
    "top --always-on: faults + slab": _TOP,
    "record, before: glibc process (every enter_f_*)": [("record", _rec())],
    "record, now: glibc process": [("record", _rec([]))],
    "record, now: glibc process with C++": [("record", _rec(_CXX))],
    "record, now: jemalloc process (its layouts + C++)": [("record", _rec(_CXX + _JEMALLOC, libc=0))],
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
            print(f"round {r + 1} {v:62} {cpu:5.2f} CPU-s  {programs:2} programs  load {load:.1f}", file=sys.stderr)
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
