"""`pymtrace top`: live view of malloc, slab, page-fault and glibc arena activity.

Full-screen by default (pymtrace.sinks.tui); --batch prints plain tables every interval like
`top -b`; --json prints one JSON document per interval. The data comes from
pymtrace.sources (BPF programs in bpf/malloc_stats, slab, faults) and, when available,
pymtrace.sources.glibc.GlibcSource (view 4).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Callable

from pymtrace.bpf import load as bpfload
from pymtrace.commands import add_budget_arguments, budget_of
from pymtrace.errors import PymtraceError
from pymtrace.sinks.batch import BatchOptions, Reporter
from pymtrace.sinks.text import printable
from pymtrace.tracee import proc
from pymtrace.units import parse_bytes

if TYPE_CHECKING:
    from pymtrace.sources.budget import Budget
    from pymtrace.sources.bundle import Sources
    from pymtrace.sources.snapshot import Snapshot
    from pymtrace.sources.stacksites import StackSitesSource

DEFAULT_SAMPLE_BYTES = 524288  # = sources.heap.DEFAULT_SAMPLE_BYTES (not imported: plain top's start-up)

HELP = """Live view of memory-allocation activity, per process and system-wide:
  1 processes  malloc/calloc/realloc/free/memalign-family calls per second, requested
               bytes/s, mean size (of the interval's calls), live bytes (allocated minus
               freed chunk bytes since attach; glibc only), page faults/s. Counted where
               each process's malloc resolves: glibc, jemalloc, tcmalloc, mimalloc or the
               program's own; one that cannot be probed says e.g.
               "allocator: static binary (no shared libc) (not traced)"
  2 slab       kernel slab caches: allocs/s, frees/s, bytes/s, net objects
  3 faults     page faults per process and per mapped region (file, [heap], [stack], [anon])
  4 glibc      glibc arenas, heaps, sbrk, thresholds, arena lock waits (needs a libc built
               with USDT probes; says so when the libc has none)
  5 stacks     with --stacks -p PID: the hottest allocation call sites (first frame outside
               libc/libstdc++) of those processes from the heap sampler: estimated bytes/s and
               calls/s, sampled bytes still in use, bytes since attach; the full stacks, root
               to leaf (Enter on a row; in --json every stack of every site)
  6 heap       heap efficiency: live bytes beside the growth of anonymous RSS since attach,
               RssAnon and RSS (/proc/PID/statm), their ratio, glibc's arena totals where
               its probes exist; FRAGMENTED? when the growth is > 1.5x live and > 64 MiB
               above it, with what to try (malloc_trim, M_ARENA_MAX, replay)
Keys in the full-screen view: 1-6/Tab view, </> sort column, r reverse, p pause, q quit;
view 5: Up/Down select a call site, Enter shows its stacks; view 6: Up/Down select a process
(its heap-efficiency line shows below); the selection follows its row when the rows re-sort."""

EPILOG = """examples:
  sudo pymtrace top                         every process, full screen
  sudo pymtrace top -p 1234 -p 5678 -i 2    two processes, 2 s refresh
  sudo pymtrace top --demo                  start the bundled demo workload and watch it
  sudo pymtrace top --batch -n 3 -p 1234    three plain-text reports (like top -b)
  sudo pymtrace top --json -n 1 -i 5 | jq '.snapshot.processes'
  sudo pymtrace top --always-on --batch     tracepoints, faults and USDT only
  sudo pymtrace top --stacks -p 1234        view 5: where 1234 allocates, live
  sudo pymtrace top -p 1234 --max-overhead 1   estimated rates at <= 1 % of its CPU time

live bytes: chunk bytes returned by malloc & co. minus chunk bytes freed, counted since
pymtrace attached; frees of blocks allocated before that are shown apart (view 6's OLDER
FREED, a note in view 1), never as negative live bytes.

OVERHEAD: the per-call view puts uprobes on malloc, calloc, realloc, free and the memalign
family of every traced libc: a malloc+free pair then costs ~2 us instead of ~10 ns
(1.7-2.0 us measured on a 2-core machine at load ~1, more when it is busy; bench/overhead.py:
about the cost of the uprobe traps alone, and ~8x cheaper than a memleak-style tracer; see
docs/top.md). A program that does little but malloc/free slows down by two orders of
magnitude; real programs much less.
Limit it with -p, with --max-overhead PCT (below), or use --always-on (no per-call uprobes:
slab and fault tracepoints and glibc's slow-path USDT probes only; nothing runs on a malloc
call) in production.
--max-overhead PCT: the per-call uprobes are attached in windows (--window seconds, at
random times) and detached between them, so that what they cost the traced processes (the
traps' calibrated cost, the BPF programs' run time from the kernel's statistics, the
attach/detach CPU: measured, shown in every view) stays under PCT % of those processes'
own CPU time. Call rates, requested bytes and sizes are then ESTIMATES with a 95 % error;
live bytes are not measured (RSS is). See docs/top.md "Overhead budget".
--stacks adds the heap sampler's programs on the same probe sites of the -p processes (one
trap runs both): ~1.3x top's per-call cost on those processes (bench/heap_overhead.py, mode
top+heap: 3.2-3.9 us a pair against top's 2.6-2.9 us), nothing on others; with
--stack-sample-bytes 1 every call also copies its stack. Start-up: ~0.9 s more CPU (its own
compile). Without --stacks nothing of it is loaded: top's start-up and cost are unchanged."""

VIEW_CHOICES = ("processes", "slab", "faults", "glibc", "stacks", "heap", "totals")
VIEW_NUMBERS = {"1": "processes", "2": "slab", "3": "faults", "4": "glibc", "5": "stacks", "6": "heap"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p",
        "--pid",
        type=int,
        action="append",
        dest="pids",
        metavar="PID",
        help="trace this process (repeatable; default: every process)",
    )
    parser.add_argument(
        "-i",
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="refresh interval (default 1); every report, the first included, covers one interval after attach",
    )
    parser.add_argument(
        "-b", "--batch", action="store_true", help="print plain tables every interval instead of the full-screen view"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document per interval (views + the raw cumulative snapshot)"
    )
    parser.add_argument(
        "-n",
        "--iterations",
        type=int,
        default=0,
        metavar="N",
        help="stop after N reports in --batch/--json mode (default: until Ctrl-C)",
    )
    parser.add_argument(
        "--view",
        action="append",
        choices=VIEW_CHOICES + tuple(VIEW_NUMBERS),
        help="full screen: the view to start in; --batch/--json: views to print, and "
        "only their programs are compiled and attached (--view slab: no uprobes) "
        "(repeatable; default all; `totals` = exact counts since attach)",
    )
    parser.add_argument(
        "--limit", type=int, default=0, metavar="ROWS", help="--batch: at most ROWS rows per table (default: all)"
    )
    parser.add_argument("--demo", action="store_true", help="start the bundled demo workload and trace it")
    parser.add_argument(
        "--always-on",
        action="store_true",
        help="no per-call uprobes: slab + page-fault tracepoints and glibc USDT "
        "probes only (cheap enough for production)",
    )
    add_budget_arguments(
        parser,
        "attach the per-call uprobes in windows so that their measured cost stays under PCT %% of "
        "the traced processes' CPU time (estimated rates, no live bytes; default: every call, exact)",
        "with --max-overhead: how long each window keeps the probes attached (longer than the traced "
        "service's request cycle)",
    )
    parser.add_argument("--no-glibc", action="store_true", help="skip the glibc USDT view (4)")
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="view 5: sample the allocation call stacks of the -p processes (heap's sampler; "
        "also enabled by --view stacks/5)",
    )
    parser.add_argument(
        "--stack-sample-bytes",
        default=str(DEFAULT_SAMPLE_BYTES),
        metavar="N",
        help=f"view 5: on average one sample per N bytes allocated (default {DEFAULT_SAMPLE_BYTES}; "
        "1: every call, exact and costly; K/M/G suffixes)",
    )


def _start_demo():
    """Start the bundled demo workload; returns (pid, stop callable)."""
    try:
        from pymtrace.tracee import demo
    except ImportError:
        raise PymtraceError("the demo workload (pymtrace/demo) is not installed") from None
    child = demo.start_demo()
    return child.pid, lambda: demo.stop_demo(child)


def _views_wanted(args: argparse.Namespace, have_glibc: bool) -> list[str]:
    wanted = []
    for v in args.view or []:
        name = VIEW_NUMBERS.get(v, v)
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        wanted = ["processes", "totals", "slab", "faults", "heap"] + (["glibc"] if have_glibc else [])
        if args.stacks:
            wanted.append("stacks")
    return wanted


def _stacks_wanted(args: argparse.Namespace) -> bool:
    """--stacks, or view 5 asked for by --view: the heap sampler runs (never otherwise)."""
    return bool(args.stacks) or any(VIEW_NUMBERS.get(v, v) == "stacks" for v in args.view or [])


VIEW_SOURCES = {
    "processes": ("malloc", "faults"),
    "totals": ("malloc", "faults"),
    "slab": ("slab",),
    "faults": ("faults",),
    "glibc": ("glibc",),
    "stacks": (),  # the heap sampler: a source of its own (sources.stacksites)
    "heap": ("malloc", "glibc"),  # live bytes and RSS; glibc's arena totals where it has probes
}


def _sources(args: argparse.Namespace) -> set[str]:
    """The bundle the views shown need (none other is compiled or attached); the full
    screen can switch to any view: all of them."""
    if not (args.batch or args.json) or not args.view:
        return {"malloc", "slab", "faults", "glibc"}
    return {s for view in _views_wanted(args, True) for s in VIEW_SOURCES[view]}


def run(args: argparse.Namespace) -> int:
    from pymtrace.sources.bundle import Sources

    # argument errors first: they need neither root nor seconds of compiling
    stacks_on = _stacks_wanted(args)
    sample_bytes = parse_bytes(args.stack_sample_bytes, "--stack-sample-bytes")
    if stacks_on:  # the sampler's module costs ~0.1 s to import: plain top does without it
        from pymtrace.sources import heap

        heap.check_settings(sample_bytes, sample_option="--stack-sample-bytes")
    if stacks_on and not (args.pids or args.demo):
        raise PymtraceError("the stacks view (--stacks, view 5) needs -p PID: the heap sampler attaches per process")
    args.stacks = stacks_on
    budget = _budget(args)
    bpfload.require_root("pymtrace top")
    if args.interval <= 0:
        raise PymtraceError("-i must be > 0")
    if not (args.batch or args.json):
        from pymtrace.sinks import tui

        tui.require_terminal()  # before seconds of BPF compiling, not after
    pids = list(args.pids or [])
    stop_demo = None
    bundle = None
    stacks = None
    try:
        if args.demo:
            pid, stop_demo = _start_demo()
            pids.append(pid)
        if stacks_on:
            # compiled and attached first, before top's own uprobes (its compile is not trapped)
            from pymtrace.sources.stacksites import StackSitesSource

            stacks = StackSitesSource(pids, sample_bytes=sample_bytes).attach()
        need = _sources(args)
        bundle = Sources(
            pids=pids or None,
            malloc=not args.always_on and "malloc" in need,
            slab="slab" in need,
            faults="faults" in need,
            glibc=not args.no_glibc and "glibc" in need,
            budget=budget,
        )
        bundle.attach()
        pids = bundle.pids or []
        source = _snapshots(bundle, stacks)
        if args.batch or args.json:
            return _run_batch(args, bundle, pids, source)
        return _run_tui(args, bundle, pids, source)
    except KeyboardInterrupt:
        return 0
    finally:
        if bundle is not None:
            bundle.close()
        if stacks is not None:
            stacks.close()
        if stop_demo is not None:
            stop_demo()


def _budget(args: argparse.Namespace) -> Budget | None:
    """--max-overhead's budget (checked), or None: every call traced."""
    return budget_of(
        args,
        [
            (args.always_on, "--max-overhead and --always-on contradict each other (--always-on: no per-call probes)"),
            (
                args.stacks,
                "--stacks samples stacks at every call's trap: it cannot run under --max-overhead (use one or the other)",
            ),
        ],
    )


def _snapshots(bundle: Sources, stacks: StackSitesSource | None) -> Callable[[], Snapshot]:
    """The function taking one snapshot: the bundle's, with the call sites when sampled."""
    if stacks is None:
        return bundle.snapshot

    def snapshot() -> Snapshot:
        from pymtrace.sources.snapshot import merge

        snap = bundle.snapshot()
        # the samples up to when the counters' reading began: the same calls (reading takes
        # seconds in an emulated VM, and the sampler goes on meanwhile)
        merged = merge([snap, stacks.snapshot(until=snap.get("time"))])
        merged["time"], merged["start"] = snap["time"], snap["start"]  # one interval for every view
        return merged

    return snapshot


def _run_batch(args: argparse.Namespace, bundle: Sources, pids: list[int], source: Callable[[], Snapshot]) -> int:
    have_glibc = "glibc" in bundle.sources
    options = BatchOptions(interval=args.interval, json=args.json, limit=args.limit)
    reporter = Reporter(options, _views_wanted(args, have_glibc), pids)
    for note in bundle.notes:
        print(f"pymtrace: note: {printable(note)}", file=sys.stderr, flush=True)
    # every report covers one interval after attach, the first included: rates from a
    # baseline taken now, never from the time spent compiling and attaching
    cur = source()
    # one interval between the snapshots' times (when their reading began), whatever the
    # reading costs (seconds in an emulated VM)
    next_at = (cur.get("time") or time.monotonic()) + args.interval
    reporter.warm_up()  # inside the first interval, not after it
    while not args.iterations or reporter.iteration < args.iterations:
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at += args.interval
        final = bool(pids) and not any(proc.alive(p) for p in pids)
        if final:
            time.sleep(0.3)  # let the exit notifications arrive: the report marks them "exited"
        prev, cur = cur, source()
        reporter.report(prev, cur)
        if final:
            print("pymtrace: all traced processes exited", file=sys.stderr)
            break
    return 0


def _run_tui(
    args: argparse.Namespace, bundle: Sources, pids: list[int], source_snapshot: Callable[[], Snapshot]
) -> int:
    from pymtrace.sinks import tui

    state = {"gone": False}
    notes = list(bundle.notes)

    def source():
        if state["gone"]:
            raise StopIteration
        snap = source_snapshot()
        if notes:
            snap.setdefault("notes", []).extend(notes)
        if pids and not any(proc.alive(p) for p in pids):
            state["gone"] = True  # show the final numbers once, end at the next refresh
        return snap

    view = "stacks" if args.stacks else None
    if args.view:
        view = args.view[0]
        if view == "totals":
            view = "processes"
    return tui.run(source, interval=args.interval, view=view)
