"""`pymtrace replay`: replay a workload against allocators and settings, side by side.

Arguments, help and orchestration only: the simulator, its configurations and runs are
pymtrace/replay/runner.py's, the table and the plot pymtrace/replay/report.py's. Each
configuration runs --repeat times; the table shows medians. A configuration that fails
(missing library, crash, the preload being ignored) is reported in its row and the others
still run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from pymtrace.errors import PymtraceError
from pymtrace.replay import report, runner
from pymtrace.trace.files import check_new
from pymtrace.trace.formats.autodetect import recorded_allocator

HELP = (
    "Replay a .wl workload (or a binary trace, converted on the fly) against allocators and tunables and compare them."
)
EPILOG = """configurations (one table row each):
  --allocator NAME[:SETTING,...]   NAME: glibc, jemalloc, tcmalloc, mimalloc or /path/lib.so
      SETTING: glibc.malloc.X=V (GLIBC_TUNABLES), M_NAME=V (mallopt), trim=N (malloc_trim)
  --tunable/--mallopt/--trim-interval apply to every configuration.
  Without --allocator: glibc, plus jemalloc/tcmalloc/mimalloc when the trace was recorded
  from that allocator (record -p on such a process; the trace names it).

examples:
  pymtrace replay app.wl --allocator glibc --allocator jemalloc --allocator tcmalloc
  pymtrace replay app.mtrace --allocator glibc --allocator glibc:glibc.malloc.arena_max=1 --repeat 5
  pymtrace replay app.wl --allocator glibc:M_MMAP_THRESHOLD=65536,trim=10000 --plot cmp.png --json
  pymtrace replay app.wl --text        # upstream trace_run style report per run

Times are CPU cycles from RDTSCP (the 'unit' column says ns when the CPU has none and
clock_gettime was used). Max RSS is the simulator's peak RSS during the replay (VmHWM):
the allocator's memory plus the simulator's own (tables, code), not the workload file, whose
pages are dropped as they are replayed. Ideal RSS is the peak of requested live bytes; peak
anon RSS comes from /proc/self/statm sampled every --sample-ms. --timeout also bounds the
validation of the workload."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help=".wl workload, or a binary mtrace trace (converted first)")
    parser.add_argument(
        "--allocator",
        action="append",
        metavar="NAME[:SETTINGS]",
        help="a configuration to run (repeatable; default glibc, plus the allocator a trace was recorded from)",
    )
    parser.add_argument(
        "--tunable",
        action="append",
        default=[],
        metavar="glibc.malloc.X=V",
        help="GLIBC_TUNABLES entry for every configuration (repeatable)",
    )
    parser.add_argument(
        "--mallopt",
        action="append",
        default=[],
        metavar="M_NAME=V",
        help="mallopt() setting for every configuration (repeatable)",
    )
    parser.add_argument(
        "--trim-interval",
        type=int,
        default=0,
        metavar="N",
        help="each replay thread calls malloc_trim(0) after every N of its calls",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="K", help="run each configuration K times, report medians"
    )
    parser.add_argument(
        "--sync",
        choices=("futex", "mutex"),
        default="futex",
        help="cross-thread ordering: futex words (default) or upstream's mutex+condvar",
    )
    parser.add_argument("--timer", choices=("auto", "rdtscp", "clock"), default="auto")
    parser.add_argument("--sample-ms", type=int, default=5, metavar="MS", help="RSS sampling interval (default 5)")
    parser.add_argument(
        "--no-fill", action="store_true", help="do not write 0x11/0x22 into blocks (pages stay untouched)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="S",
        help="stop validating the workload, or a run, after S seconds (default 600)",
    )
    parser.add_argument("--plot", metavar="FILE.png|svg", help="plot RSS over time and cycles per call type")
    parser.add_argument(
        "--force", action="store_true", help="replace the --plot FILE if it exists (never through a symlink)"
    )
    parser.add_argument("--json", action="store_true", help="print all results as JSON instead of the table")
    parser.add_argument("--text", action="store_true", help="also print each run's upstream-style text report")


REPLAYABLE = ("jemalloc", "tcmalloc", "mimalloc")  # families replay can load by name


def default_allocators(workload: str) -> list[str]:
    """The configurations without --allocator: glibc, and the allocator the trace was
    recorded from when it names one replay can load (said on stderr)."""
    family = recorded_allocator(workload) if os.path.isfile(workload) else None
    if family in REPLAYABLE:
        print(
            f"pymtrace: {workload} was recorded from {family}: replaying against glibc and {family} "
            "(--allocator to choose)",
            file=sys.stderr,
        )
        return ["glibc", family]
    if family is not None:
        print(
            f"pymtrace: {workload} was recorded from the program's own malloc, which replay cannot load: "
            "replaying against glibc (--allocator /path/lib.so for another)",
            file=sys.stderr,
        )
    return ["glibc"]


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise PymtraceError("--repeat must be at least 1")
    if args.plot:
        check_new(args.plot, args.force)  # before the replay, not after it
    specs = args.allocator or default_allocators(args.workload)
    configs = [runner.Config(s, args.tunable, args.mallopt, args.trim_interval) for s in specs]
    options = runner.RunOptions(
        sync=args.sync,
        timer=args.timer,
        sample_ms=args.sample_ms,
        text=args.text,
        no_fill=args.no_fill,
        timeout=args.timeout,
    )
    sim = runner.simulator_path()
    with tempfile.TemporaryDirectory(prefix="pymtrace-replay-") as tmp:
        wl_path, conv = runner.prepare_workload(args.workload, tmp)
        runner.check_workload(sim, wl_path, args.workload, args.timeout)
        rows = []
        for n, cfg in enumerate(configs):
            results, error = [], None
            for k in range(args.repeat):
                try:
                    res, error, text = runner.run_once(
                        sim, wl_path, cfg, options, os.path.join(tmp, f"run{n}-{k}.json")
                    )
                except PymtraceError as exc:
                    res, error, text = None, str(exc), ""
                if args.text and text:
                    print(f"== {cfg.label} (run {k + 1}) ==\n{text}", file=sys.stderr if args.json else sys.stdout)
                if error:
                    break
                results.append(res)
            rows.append((cfg.label, runner.median_result(results) if not error else None, error))
    if args.plot:
        report.plot(rows, args.plot, args.force)
    if args.json:
        json.dump(
            {
                "workload": args.workload,
                "converted": conv,
                "configurations": [{"configuration": label, "error": err, "result": r} for label, r, err in rows],
            },
            sys.stdout,
            indent=1,
        )
        print()
    else:
        from tabulate import tabulate

        headers, body = report.table_rows(rows)
        print(
            tabulate(
                body, headers=headers, disable_numparse=True, colalign=["left", "left"] + ["right"] * (len(headers) - 2)
            )
        )
    return 0 if any(r is not None for _, r, _ in rows) else 1
