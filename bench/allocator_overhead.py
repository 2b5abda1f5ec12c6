#!/usr/bin/env python3
"""CPU cost of top's per-call counting on each allocator: the same storm (bench/storm.c,
malloc(SIZE)+free pairs, one thread) under glibc, jemalloc, tcmalloc and mimalloc.

    sudo /opt/pymtrace/venv/bin/python bench/allocator_overhead.py [--rounds 7] [--pairs 50000]

One storm process per allocator, each on a private copy of its library (glibc: a private
libc copy; the others LD_PRELOADed copies: bench/benchutil.py), so uprobes other tracers put
on the system's files cannot slow it down. malloc_stats is compiled once; in each round
every (allocator, mode) runs once, the order rotating from round to round: `untraced` (no
probes) and `top` (malloc_stats' uprobes exactly as top attaches them for that allocator:
pymtrace.sources.malloc.probe_plan for glibc, pymtrace.tracee.allocators.probe_plan for the
others). The time is the storm's CPU time (/proc/PID/schedstat: on-CPU nanoseconds, the
uprobe traps included, since the kernel runs them in the storm's context) per pair, not
wall time. Prints a markdown table: min and median CPU ns per pair, and top / untraced.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchutil import private_libc_storm, private_preload_storm, uprobe_pids  # noqa: E402

from pymtrace.bpf import load as bpfload  # noqa: E402
from pymtrace.sources import malloc  # noqa: E402
from pymtrace.tracee import allocators, libc  # noqa: E402

LIBDIR = "/usr/lib/x86_64-linux-gnu"
PRELOADS = {
    "jemalloc": f"{LIBDIR}/libjemalloc.so.2",
    "tcmalloc": f"{LIBDIR}/libtcmalloc_minimal.so.4",
    "mimalloc": f"{LIBDIR}/libmimalloc.so.2",
}


def cpu_ns(pid):
    """On-CPU nanoseconds of PID's main thread (the storm has one thread)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def uprobes(name, path):
    """top's uprobes for the allocator NAME in PATH: [(kind, function, offset, program)]."""
    if name == "glibc":
        return [(kind, fn, off, prog) for fn, probes in malloc.probe_plan(path) for kind, off, prog in probes]
    return [(p.kind, fn, p.offset, p.program) for fn, probes in allocators.probe_plan(path, name) for p in probes]


def attach(bpf, path, plan, pid, on):
    for kind, fn, off, prog in plan:
        if kind == "entry":
            if on:
                bpf.attach_uprobe(name=path, sym=fn, sym_off=off, fn_name=prog, pid=pid)
            else:
                bpf.detach_uprobe(name=path, sym=fn, sym_off=off, pid=pid)
        else:
            addr = libc.symbol(path, fn).address + off
            if on:
                bpf.attach_uretprobe(name=path, addr=addr, fn_name=prog, pid=pid)
            else:
                bpf.detach_uretprobe(name=path, addr=addr, pid=pid)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=50000, help="pairs per traced measurement")
    ap.add_argument("--fast-pairs", type=int, default=5000000, help="pairs per untraced measurement")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--allocators", default="glibc,jemalloc,tcmalloc,mimalloc")
    args = ap.parse_args()
    bpfload.require_root("the allocator overhead benchmark")
    names = args.allocators.split(",")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-bench-"))
    storms = {}
    bpf = None
    try:
        for name in names:
            sub = tmp / name
            sub.mkdir()
            if name == "glibc":
                storms[name] = private_libc_storm(sub)
            else:
                storms[name] = private_preload_storm(sub, PRELOADS[name])
        bpf = bpfload.load("malloc_stats")
        plans = {name: uprobes(name, storms[name][2]) for name in names}
        runs = [(name, mode) for name in names for mode in ("untraced", "top")]
        results = {run: [] for run in runs}

        def measure(name, mode):
            storm, pid, path = storms[name]
            pairs = args.fast_pairs if mode == "untraced" else args.pairs
            if mode == "top":
                attach(bpf, path, plans[name], pid, True)
            try:
                for _ in range(5):
                    before = uprobe_pids(path)
                    t0 = cpu_ns(pid)
                    storm.stdin.write(f"{pairs} {args.size}\n")
                    storm.stdin.flush()
                    storm.stdout.readline()
                    value = (cpu_ns(pid) - t0) / pairs
                    if not before and not uprobe_pids(path):
                        return value
                raise SystemExit(f"other processes keep probing {path}")
            finally:
                if mode == "top":
                    attach(bpf, path, plans[name], pid, False)

        for name in names:  # warm-up: stdio buffers, the allocators' caches
            measure(name, "untraced")
        for r in range(args.rounds):
            order = runs[r % len(runs) :] + runs[: r % len(runs)]
            for run in order:
                results[run].append(measure(*run))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        for storm, _pid, _path in storms.values():
            storm.stdin.close()
            storm.wait()
        if bpf is not None:
            bpfload.detach_all(bpf)
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"{args.rounds} interleaved rounds, one thread, malloc({args.size})+free pairs "
        f"({args.pairs} per traced measurement, {args.fast_pairs} untraced), CPU time (schedstat), "
        f"kernel {os.uname().release}, load {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| allocator | untraced CPU ns/pair min | median | top CPU ns/pair min | median | top / untraced (paired median) |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        u, t = results[(name, "untraced")], results[(name, "top")]
        ratio = statistics.median(x / y for x, y in zip(t, u))
        print(
            f"| {name} | {min(u):.0f} | {statistics.median(u):.0f} | {min(t):.0f} | {statistics.median(t):.0f} "
            f"| {ratio:.0f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
