#!/usr/bin/env python3
"""What `pymtrace record --via uprobes` adds per call, by call type (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/cxx_record_bench.py [--rounds 5] [--pairs 200000]

A C++ program (g++ -O2) times N pairs of one kind itself, from the first pair to the last
(the tool's start-up and end apart), and prints nanoseconds per pair:

  malloc+free           malloc(64); free
  new+delete            std::allocator<char>: ::operator new(64); sized ::operator delete(p, 64)
                        (what a container's allocator calls under -O2: _Znwm, _ZdlPvm)
  new[]+delete[]        new char[64]; delete[] (_Znam, _ZdaPv)
  nothrow new+delete    ::operator new(64, std::nothrow); ::operator delete(p)
  aligned new+delete    ::operator new(64, align_val_t(64)); ::operator delete(p, align_val_t(64))

Each round runs every kind untraced and under `record --via uprobes -o FILE -- PROG`, the
order rotating from round to round; reported: the program's CPU time added per pair (the
uprobe traps' kernel time is the process's: less disturbed by a loaded machine than wall
time) and its wall time added, traced minus untraced of the same round, min and median over
rounds, and the records each traced run wrote per pair
(2: nothing recorded twice, nothing lost). --baseline DIR records with a second checkout of
pymtrace too (another commit, `git archive`d), in the same rounds: before and after in one
run. Only ratios inside one run mean anything: the machine is shared.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchutil import print_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "pymtrace"]

PAIRS = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <new>

static double now_ns(clockid_t clock) {
    timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const char *kind = argv[1];
    long n = atol(argv[2]);
    std::allocator<char> a;
    const std::align_val_t al = std::align_val_t(64);
    double t0 = now_ns(CLOCK_MONOTONIC), c0 = now_ns(CLOCK_PROCESS_CPUTIME_ID);
    if (!strcmp(kind, "malloc")) {
        for (long i = 0; i < n; i++) {
            char *volatile p = (char *)malloc(64);
            free(p);
        }
    } else if (!strcmp(kind, "new")) {
        for (long i = 0; i < n; i++) {
            char *volatile p = a.allocate(64);
            a.deallocate(p, 64);
        }
    } else if (!strcmp(kind, "new_array")) {
        for (long i = 0; i < n; i++) {
            char *volatile p = new char[64];
            delete[] p;
        }
    } else if (!strcmp(kind, "nothrow")) {
        for (long i = 0; i < n; i++) {
            void *volatile p = ::operator new(64, std::nothrow);
            ::operator delete(p);
        }
    } else if (!strcmp(kind, "aligned")) {
        for (long i = 0; i < n; i++) {
            void *volatile p = ::operator new(64, al);
            ::operator delete(p, al);
        }
    } else {
        return 2;
    }
    double c1 = now_ns(CLOCK_PROCESS_CPUTIME_ID), t1 = now_ns(CLOCK_MONOTONIC);
    printf("%.1f %.1f\n", (t1 - t0) / n, (c1 - c0) / n); /* the uprobe traps' kernel time counts too */
    return 0;
}
"""

KINDS = {
    "malloc": "malloc+free",
    "new": "new+delete (sized)",
    "new_array": "new[]+delete[]",
    "nothrow": "nothrow new+delete",
    "aligned": "aligned new+delete",
}


def run(prog, kind, pairs, out=None, root=ROOT):
    """(wall ns per pair, CPU ns per pair, records written or None) of PROG KIND PAIRS, under
    record (pymtrace from the checkout ROOT) when OUT."""
    argv = [prog, kind, str(pairs)]
    if out is not None:
        argv = [*PY, "record", "--json", "--force", "--via", "uprobes", "-o", out, "--", *argv]
    env = dict(os.environ, PYTHONPATH=str(root))  # run from elsewhere: `python -m` imports from the cwd first
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=os.path.dirname(prog))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-400:]}")
    records = json.loads(proc.stderr.strip().splitlines()[-1])["entries"] if out is not None else None
    wall, cpu = map(float, proc.stdout.split()[-2:])
    return wall, cpu, records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--baseline", help="another pymtrace checkout (a directory) to record with too, interleaved")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    roots = {"": ROOT} if not args.baseline else {"baseline": pathlib.Path(args.baseline), "this": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "pairs.cpp")
        with open(src, "w") as f:
            f.write(PAIRS)
        prog = os.path.join(tmp, "pairs")
        subprocess.run(["g++", "-O2", "-std=c++17", "-o", prog, src], check=True)
        out = os.path.join(tmp, "trace")
        wall = {(k, r): [] for k in kinds for r in roots}
        cpu = {(k, r): [] for k in kinds for r in roots}
        records = {(k, r): [] for k in kinds for r in roots}
        for i in range(args.rounds):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                base_wall, base_cpu, _ = run(prog, kind, args.pairs)
                for name, root in roots.items():
                    traced_wall, traced_cpu, n = run(prog, kind, args.pairs, out, root)
                    wall[kind, name].append(traced_wall - base_wall)
                    cpu[kind, name].append(traced_cpu - base_cpu)
                    records[kind, name].append(n)
    rows = []
    for kind in kinds:
        for name in roots:
            row = {"pairs": KINDS[kind] + (f" ({name})" if name else "")}
            c = cpu[kind, name]
            row["CPU ns added per pair (min/med)"] = f"{min(c):.0f} / {statistics.median(c):.0f}"
            row["wall ns added (min/med)"] = f"{min(wall[kind, name]):.0f} / {statistics.median(wall[kind, name]):.0f}"
            row["records per pair"] = f"{statistics.median(records[kind, name]) / args.pairs:.3f}"
            if "malloc" in kinds:
                row["CPU / malloc+free's (med)"] = (
                    f"{statistics.median(c) / statistics.median(cpu['malloc', name]):.2f}"
                )
            rows.append(row)
    print(f"record --via uprobes, {args.pairs} pairs, {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
