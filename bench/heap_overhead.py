#!/usr/bin/env python3
"""CPU cost per malloc+free pair of `pymtrace heap`'s BPF side against `top`'s (bench/storm.c).

    sudo /opt/pymtrace/venv/bin/python bench/heap_overhead.py [--rounds 5] [--pairs 200000]

Modes, in interleaved rounds (the order rotating) against ONE storm process on a private
copy of its libc (as bench/overhead.py: other tracers' system-wide probes cannot hit it):

  untraced    no probes
  top         top's malloc_stats programs on top's uprobe sites (sources.malloc.probe_plan)
  heap        HeapSource at the default sampling (512 KiB): the same traps, plus the
              sampler; one call in ~8000 (64-byte blocks) copies 32 KiB of stack
  heap-every  HeapSource at sample_bytes=1: every call copies the stack into the ring
              (a thread consumes it, as the command will)
  top+heap    top's and heap's (default sampling) probes together: `top --stacks -p PID`
              (one trap at a shared site runs both programs)
  heap-every-N  with --small-stack-bytes N: heap-every copying at most N bytes of stack
              (how much of heap-every's cost is the stack copy)
  heap-every-reserve  heap-every built with HP_RESERVE 1: a ring record of the largest size
              reserved and the stack copied into it once (heap-every: into a per-CPU slot,
              then ringbuf_output of the bytes copied, two copies)

Each source is compiled and attached once; between measurements only its uprobes are
attached/detached. The cost is the storm process's CPU time (utime + stime from
/proc/PID/stat, which includes the probes' kernel time), divided by the pairs. Prints a
markdown table: min and median CPU ns per pair, and paired ratios to top.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchutil import private_libc_storm, uprobe_pids  # noqa: E402

from pymtrace.bpf import load as bpfload  # noqa: E402
from pymtrace.sources import malloc  # noqa: E402
from pymtrace.sources.heap import HeapSource  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Probes:
    """A compiled program's uprobes on PATH for PID, switched on and off between measurements."""

    def __init__(self, bpf, plan, path, pid):
        self.bpf, self.path, self.pid = bpf, path.encode(), pid
        self.probes = [(kind, fn, off, prog) for fn, probes in plan for kind, off, prog in probes]

    def attach(self):
        for kind, fn, off, prog in self.probes:
            if kind == "entry":
                self.bpf.attach_uprobe(
                    name=self.path, sym=fn.encode(), sym_off=off, fn_name=prog.encode(), pid=self.pid
                )
            else:
                self.bpf.attach_uretprobe(name=self.path, sym=fn.encode(), fn_name=prog.encode(), pid=self.pid)

    def detach(self):
        for kind, fn, off, _ in self.probes:
            if kind == "entry":
                self.bpf.detach_uprobe(name=self.path, sym=fn.encode(), sym_off=off, pid=self.pid)
            else:
                self.bpf.detach_uretprobe(name=self.path, sym=fn.encode(), pid=self.pid)


class Both:
    """Two programs' probes attached together (top --stacks)."""

    def __init__(self, *probes):
        self.probes = probes

    def attach(self):
        for p in self.probes:
            p.attach()

    def detach(self):
        for p in reversed(self.probes):
            p.detach()


def heap_mode(path, pid, sample_bytes, **options):
    """A HeapSource on the private libc (not named libc.so.6: set by hand), probes detached."""
    c = HeapSource({pid}, sample_bytes=sample_bytes, **options)  # records read and dropped
    c.libcs, c.prepared = {path: [pid]}, True
    c.plan()
    c.attach()
    probes = Probes(c.bpf, c.plans[path], path, pid)
    probes.detach()
    return c, probes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=200000, help="pairs per traced measurement")
    ap.add_argument("--fast-pairs", type=int, default=20000000, help="pairs per untraced measurement")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--small-stack-bytes", type=int, help="also heap-every with this --stack-bytes")
    args = ap.parse_args()
    bpfload.require_root("the heap overhead benchmark")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-bench-"))
    storm, pid, path = private_libc_storm(tmp)

    top_bpf = bpfload.load("malloc_stats")
    top = Probes(top_bpf, malloc.probe_plan(path), path, pid)
    heap, heap_probes = heap_mode(path, pid, 524288)
    every, every_probes = heap_mode(path, pid, 1)
    reserve, reserve_probes = heap_mode(path, pid, 1, reserve=True)
    modes = {
        "untraced": None,
        "top": top,
        "heap": heap_probes,
        "heap-every": every_probes,
        "heap-every-reserve": reserve_probes,
        "top+heap": Both(top, heap_probes),
    }
    sources = {"heap": heap, "heap-every": every, "heap-every-reserve": reserve}
    if args.small_stack_bytes:
        name = f"heap-every-{args.small_stack_bytes}"
        sources[name], modes[name] = heap_mode(path, pid, 1, stack_bytes=args.small_stack_bytes)
    results = {n: [] for n in modes}
    stop = threading.Event()

    def consume():
        while not stop.is_set():
            for c in sources.values():
                c.poll(1)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()

    def measure(name):
        pairs = args.fast_pairs if name == "untraced" else args.pairs
        before_probes = uprobe_pids(path)
        t0 = cpu_seconds(pid)
        storm.stdin.write(f"{pairs} {args.size}\n")
        storm.stdin.flush()
        storm.stdout.readline()
        ns = (cpu_seconds(pid) - t0) * 1e9 / (pairs + 1000)
        if before_probes or uprobe_pids(path):
            print(f"warning: other processes probed the benchmark's libc during {name}", file=sys.stderr)
        return ns

    try:
        measure("untraced")  # warm up
        names = list(modes)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                probes = modes[name]
                if probes is not None:
                    probes.attach()
                try:
                    results[name].append(measure(name))
                finally:
                    if probes is not None:
                        probes.detach()
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in results.items()), file=sys.stderr)
    finally:
        stop.set()
        consumer.join()
        drops = {name: c.drops() for name, c in sources.items()}
        storm.stdin.close()
        storm.wait()
        for c in sources.values():
            c.close()
        bpfload.detach_all(top_bpf)
        shutil.rmtree(tmp, ignore_errors=True)

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(results[a], results[b]))

    print(
        f"{args.rounds} interleaved rounds, malloc({args.size})+free pairs, CPU time of the storm process "
        f"({args.pairs} pairs per traced measurement), kernel {os.uname().release}\n"
    )
    print("| mode | CPU ns/pair min | CPU ns/pair median | vs top (paired median) |")
    print("|---|---|---|---|")
    for n, v in results.items():
        print(f"| {n} | {min(v):.0f} | {statistics.median(v):.0f} | {paired(n, 'top'):.2f}x |")
    print(f"\ndrops: {drops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
