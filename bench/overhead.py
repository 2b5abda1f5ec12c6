#!/usr/bin/env python3
"""Overhead of `pymtrace top` per malloc+free pair (single-thread storm, bench/storm.c).

    sudo /opt/pymtrace/venv/bin/python bench/overhead.py [--rounds 10] [--pairs 500000]

Modes, measured in interleaved rounds (each round runs every mode once, the order rotating
from round to round) against ONE storm process, so only ratios inside this run matter:

  untraced    no probes
  floor       empty BPF programs on exactly top's uprobe sites (malloc entry+return,
              free at its `push`, free(NULL)'s `ret`, calloc/realloc/memalign family)
  top         top's programs: malloc_stats uprobes + page-fault and slab tracepoints
  memleak     memleak-style: malloc entry+return and free at +0, hash of live blocks
  always-on   top --always-on: page-fault and slab tracepoints only (+ glibc USDT probes
              where the libc has them; Debian's has none, so there are none to hit here)

Every program is compiled once; between modes only the attachments change (uprobes for
the storm's PID, tracepoints attached/detached), so compile time does not disturb the
measurement. Prints a markdown table: min and median ns per pair, and ratios.

The storm runs on a private copy of its libc (LD_LIBRARY_PATH): uprobes are attached to a
file's inode, so system-wide tracers of other users of the machine (which probe the system
libc) cannot slow it down. The copy is named bench-libc.so (reached through a libc.so.6
symlink), so system-wide pymtrace instances, which look for files named libc.so.6 in
/proc/*/maps, do not attach to it either. Before and after every measurement the script
checks (bpftool perf list) that no other process probes the copy, and discards and repeats
a measurement that was disturbed.

--allocator LIBRARY (e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2) runs the storm with a
private copy of that allocator LD_PRELOADed instead, and floor/top use top's probes for it
(pymtrace.tracee.allocators: every allocating call an outer call with a return probe).
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

from benchutil import build_c, private_libc_storm, private_preload_storm, start_storm, uprobe_pids  # noqa: E402

from pymtrace.bpf import load as bpfload  # noqa: E402
from pymtrace.sources import malloc  # noqa: E402
from pymtrace.sources.faults import FaultSource  # noqa: E402
from pymtrace.tracee import allocators, libc  # noqa: E402

MEMLEAK = r"""
#include <uapi/linux/ptrace.h>
BPF_HASH(sizes, u64, u64, 10240);
BPF_HASH(live, u64, u64, 1000000);
int ml_malloc_entry(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid(), size = PT_REGS_PARM1(ctx);
    sizes.update(&id, &size);
    return 0;
}
int ml_malloc_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid(), addr = PT_REGS_RC(ctx);
    u64 *size = sizes.lookup(&id);
    if (!size) return 0;
    u64 s = *size;
    sizes.delete(&id);
    if (addr) live.update(&addr, &s);
    return 0;
}
int ml_free_entry(struct pt_regs *ctx) {
    u64 addr = PT_REGS_PARM1(ctx);
    live.delete(&addr);
    return 0;
}
"""


class Attachments:
    """Uprobes/tracepoints of one compiled program that can be attached and detached."""

    def __init__(self, bpf, uprobes=(), tracepoints=()):
        self.bpf = bpf
        self.uprobes = list(uprobes)  # (kind, path, function, offset, fn_name)
        self.tracepoints = list(tracepoints)  # (tp, fn_name)
        for tp, _ in self.tracepoints:  # TRACEPOINT_PROBE attaches at load: start detached
            try:
                bpf.detach_tracepoint(tp)
            except Exception:
                pass

    def attach(self, pid):
        for kind, path, fn, off, prog in self.uprobes:
            if kind == "entry":
                self.bpf.attach_uprobe(name=path, sym=fn, sym_off=off, fn_name=prog, pid=pid)
            elif off:  # on the moved entry site, as MallocSource attaches it
                self.bpf.attach_uretprobe(name=path, addr=libc.symbol(path, fn).address + off, fn_name=prog, pid=pid)
            else:
                self.bpf.attach_uretprobe(name=path, sym=fn, fn_name=prog, pid=pid)
        for tp, prog in self.tracepoints:
            self.bpf.attach_tracepoint(tp=tp, fn_name=prog)

    def detach(self, pid):
        for kind, path, fn, off, _prog in self.uprobes:
            if kind == "entry":
                self.bpf.detach_uprobe(name=path, sym=fn, sym_off=off, pid=pid)
            elif off:
                self.bpf.detach_uretprobe(name=path, addr=libc.symbol(path, fn).address + off, pid=pid)
            else:
                self.bpf.detach_uretprobe(name=path, sym=fn, pid=pid)
        for tp, _ in self.tracepoints:
            self.bpf.detach_tracepoint(tp)


FAMILY = None  # --allocator: the pymtrace.tracee.allocators family probed instead of glibc


def top_uprobes(path):
    """top's uprobe sites, exactly as MallocSource attaches them (malloc.probe_plan, or
    allocators.probe_plan for --allocator)."""
    if FAMILY is not None:
        return [
            (p.kind, path, function, p.offset, p.program)
            for function, probes in allocators.probe_plan(path, FAMILY)
            for p in probes
        ]
    return [(kind, path, function, off, fn) for function, probes in malloc.probe_plan(path) for kind, off, fn in probes]


def floor_program(uprobes):
    """The floor's BPF source: for each program UPROBES attach, one of the same name that returns
    at once (what the uprobes cost without top's work)."""
    programs = [f"int {name}(struct pt_regs *ctx) {{ return 0; }}\n" for name in sorted({p for *_, p in uprobes})]
    return "#include <uapi/linux/ptrace.h>\n" + "".join(programs)


def tracepoints(bpf, names):
    return [(f"{cat}:{ev}", f"tracepoint__{cat}__{ev}") for cat, ev in names]


SLAB_TPS = (("kmem", "kmem_cache_alloc"), ("kmem", "kmem_cache_free"))
FAULT_TPS = (("exceptions", "page_fault_user"), ("exceptions", "page_fault_kernel"))


def fault_source(pid):
    """top's page-fault source for PID, exactly as top runs it (with its region reader
    thread consuming the pf_new ring buffer), tracepoints left for Attachments to switch."""
    c = FaultSource(pids=[pid], track_exits=False)
    c.attach()
    COLLECTORS.append(c)
    return c.bpf


COLLECTORS = []


def build_modes(path, pid):
    import bcc

    uprobes = top_uprobes(path)
    floor = bcc.BPF(text=floor_program(uprobes))
    ms = bpfload.load("malloc_stats")
    faults = fault_source(pid)
    slab = bpfload.load("slab")
    faults2 = fault_source(pid)
    slab2 = bpfload.load("slab")
    memleak = bcc.BPF(text=MEMLEAK)
    return {
        "untraced": [],
        "floor": [Attachments(floor, uprobes)],
        "top": [
            Attachments(ms, uprobes),
            Attachments(faults, (), tracepoints(faults, FAULT_TPS)),
            Attachments(slab, (), tracepoints(slab, SLAB_TPS)),
        ],
        "memleak": [
            Attachments(
                memleak,
                [
                    ("entry", path, "malloc", 0, "ml_malloc_entry"),
                    ("return", path, "malloc", 0, "ml_malloc_return"),
                    ("entry", path, "free", 0, "ml_free_entry"),
                ],
            )
        ],
        "always-on": [
            Attachments(faults2, (), tracepoints(faults2, FAULT_TPS)),
            Attachments(slab2, (), tracepoints(slab2, SLAB_TPS)),
        ],
    }, [floor, ms, faults, slab, faults2, slab2, memleak]


def print_fault_table(results):
    """Markdown table of page-fault storm results {mode: [ns per page]} (after a blank line)."""
    print()
    print("| mode | ns/page min | ns/page median | vs untraced (paired median) |")
    print("|---|---|---|---|")
    for n, v in results.items():
        ratio = statistics.median(x / y for x, y in zip(v, results["untraced"]))
        print(f"| {n} | {min(v):.0f} | {statistics.median(v):.0f} | {ratio:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=300000, help="pairs per measurement of the traced modes")
    ap.add_argument(
        "--fast-pairs",
        type=int,
        default=20000000,
        help="pairs per measurement of untraced and always-on (~10 ns a pair: a short run "
        "would measure scheduling noise)",
    )
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument(
        "--fault-pages",
        type=int,
        default=200000,
        help="also measure a page-fault storm of this many pages per measurement (untraced, top, always-on); 0: skip",
    )
    ap.add_argument(
        "--fresh-fault-pages",
        type=int,
        default=200000,
        help="also measure a page-fault storm on fresh addresses (every granule new) "
        "of this many pages per measurement (untraced, top's fault source); 0: skip",
    )
    ap.add_argument(
        "--modes",
        default="untraced,floor,top,memleak,always-on",
        help="comma-separated subset of the modes (untraced and floor are always kept)",
    )
    ap.add_argument("--allocator", metavar="LIBRARY", help="LD_PRELOAD this allocator (a private copy) into the storm")
    args = ap.parse_args()
    bpfload.require_root("the overhead benchmark")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-bench-"))
    if args.allocator:
        global FAMILY
        storm, pid, path = private_preload_storm(tmp, args.allocator)
        FAMILY = allocators.family_of(libc.allocator(pid).name)
    else:
        storm, pid, path = private_libc_storm(tmp)
    modes, objects = build_modes(path, pid)
    fresh = fresh_modes = None
    fresh_results = {"untraced": [], "top": []}
    if args.fresh_fault_pages:
        # storm.c's fresh-address fault storm: each 64 KiB granule is new, so the faults program
        # creates a pf_regions key and sends a pf_new record every 16 faults, and
        # FaultSource's reader re-reads /proc/PID/maps for each new chunk (the worst case
        # for region attribution); the "N 0" storm reuses its addresses after the first chunk
        fresh_exe = build_c(tmp, "fresh", HERE / "storm.c", flags=["-O2"])
        fresh, fresh_pid = start_storm([fresh_exe, "fresh"])
        fc = fault_source(fresh_pid)
        fresh_modes = {"untraced": [], "top": [Attachments(fc, (), tracepoints(fc, FAULT_TPS))]}

    def measure_fresh(name):
        for a in fresh_modes[name]:
            a.attach(fresh_pid)
        try:
            fresh.stdin.write(f"{args.fresh_fault_pages}\n")
            fresh.stdin.flush()
            line = fresh.stdout.readline()
            if not line.strip():
                raise SystemExit("the fresh-address fault storm failed")
            fresh_results[name].append(float(line))
        finally:
            for a in fresh_modes[name]:
                a.detach(fresh_pid)

    wanted = set(args.modes.split(",")) | {"untraced", "floor"}
    names = [n for n in modes if n in wanted]
    results = {n: [] for n in names}

    discarded = []
    fault_results = {n: [] for n in ("untraced", "top", "always-on") if n in names}

    def measure_faults():
        storm.stdin.write(f"{args.fault_pages} 0\n")
        storm.stdin.flush()
        return float(storm.stdout.readline())

    def measure(name="warm-up"):
        pairs = args.fast_pairs if name in ("untraced", "always-on") else args.pairs
        for _ in range(5):
            before = uprobe_pids(path)
            storm.stdin.write(f"{pairs} {args.size}\n")
            storm.stdin.flush()
            value = float(storm.stdout.readline())
            after = uprobe_pids(path)
            if not before and not after:
                return value
            discarded.append((name, value, sorted(set(before or []) | set(after or []))))
        raise SystemExit(f"other processes keep probing the benchmark's libc: {discarded[-1][2]}")

    try:
        measure()  # warm up the process (stdio buffers, tcache)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                for a in modes[name]:
                    a.attach(pid)
                try:
                    results[name].append(measure(name))
                    if args.fault_pages and name in fault_results:
                        fault_results[name].append(measure_faults())
                finally:
                    for a in modes[name]:
                        a.detach(pid)
            if fresh is not None:
                for name in ("untraced", "top") if r % 2 == 0 else ("top", "untraced"):
                    measure_fresh(name)
            print(
                f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {results[n][-1]:.0f}" for n in names),
                file=sys.stderr,
            )
    finally:
        storm.stdin.close()
        storm.wait()
        if fresh is not None:
            fresh.stdin.close()
            fresh.wait()
        for c in COLLECTORS:
            if fresh is not None:
                lost = c.snapshot()["lost"].get("fault_ringbuf", 0)
                if lost:
                    print(f"pf_new records lost (ring buffer full): {lost}", file=sys.stderr)
            c.close()
        for o in objects:
            bpfload.detach_all(o)
        shutil.rmtree(tmp, ignore_errors=True)

    mins = {n: min(v) for n, v in results.items()}
    meds = {n: statistics.median(v) for n, v in results.items()}

    def paired(a, b):
        """Median over rounds of A/B measured in the same round (the machine's load drifts
        between rounds; within a round the modes run back to back)."""
        return statistics.median(x / y for x, y in zip(results[a], results[b]))

    print(
        f"{args.rounds} interleaved rounds, one thread, malloc({args.size})+free pairs "
        f"({args.pairs} per traced measurement, {args.fast_pairs} untraced/always-on), "
        f"{'allocator' if args.allocator else 'libc'} copy of {args.allocator or libc.system_libc()}, "
        f"kernel {os.uname().release}\n"
    )
    print("| mode | ns/pair min | ns/pair median | vs untraced (paired median) | vs floor (paired median) |")
    print("|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {mins[n]:.0f} | {meds[n]:.0f} | {paired(n, 'untraced'):.2f}x | {paired(n, 'floor'):.2f}x |")
    if args.fault_pages and len(fault_results) == 3:
        print()
        print(f"page-fault storm ({args.fault_pages} fresh pages per measurement, mmap + touch + munmap):")
        print_fault_table(fault_results)
    if fresh is not None:
        print()
        print(
            f"page-fault storm on fresh addresses ({args.fresh_fault_pages} pages per measurement, every 64 KiB "
            f"granule new: a pf_new record per 16 faults, /proc/PID/maps re-read per new mapping; "
            f"{getattr(COLLECTORS[-1], 'maps_reads', 0)} maps reads in all):"
        )
        print_fault_table(fresh_results)
    if set(names) != set(modes):
        return 0
    print()
    print(
        f"top / floor = {paired('top', 'floor'):.2f}x paired median, {mins['top'] / mins['floor']:.2f}x of minima "
        f"(target <= 1.2x)"
    )
    print(
        f"memleak-style / top = {paired('memleak', 'top'):.2f}x paired median, "
        f"{mins['memleak'] / mins['top']:.2f}x of minima (target >= 2.5x)"
    )
    print(
        f"always-on slowdown = {(paired('always-on', 'untraced') - 1) * 100:+.1f}% paired median, "
        f"{(mins['always-on'] / mins['untraced'] - 1) * 100:+.1f}% of minima (target < 2%)"
    )
    if discarded:
        print(
            f"{len(discarded)} measurement(s) discarded and repeated because other processes "
            f"probed the benchmark's libc: {discarded}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
