"""`pymtrace workload TRACE -o OUT.wl`: convert a binary call trace into a replay workload.

Arguments, help and the summary line only; the conversion (upstream trace2wl's algorithm,
its defects fixed, bounded memory) is pymtrace/trace/workload.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

from pymtrace.errors import PymtraceError
from pymtrace.trace import workload

HELP = "Convert a binary malloc call trace (pymtrace record, mtrace-bin or parquet, or upstream mtrace.out) into a .wl replay workload."
EPILOG = """examples:
  pymtrace workload app.mtrace -o app.wl
  cat mtrace.out.1234 | pymtrace workload - -o app.wl
  pymtrace workload --upstream-compat mtrace.out.1234 -o same-bytes-as-trace2wl.wl
  pymtrace workload --for-trace-run app.mtrace -o app.wl   # also replayable by upstream trace_run

Memory stays bounded by the live pointers, threads and --freed-cache, not the trace size;
per-thread streams are spooled to a temporary file (--tmpdir, default $TMPDIR).
Warnings about unrepaired inversions and invalid frees go to stderr, one line per record
(the first --max-warnings); the summary line (stdout, or stderr with -o -) counts them all."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="binary trace file (mtrace-bin or parquet), or - for standard input (mtrace-bin)")
    parser.add_argument("-o", "--output", required=True, help="output .wl file (- for standard output)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (never through a symlink)")
    parser.add_argument(
        "--upstream-compat",
        action="store_true",
        help="reproduce upstream trace2wl's output byte for byte, defects included",
    )
    parser.add_argument(
        "--for-trace-run",
        action="store_true",
        help="write valloc/pvalloc as MEMALIGN(pagesize, ...) so upstream trace_run, which aborts "
        "on VALLOC/PVALLOC, can replay the file",
    )
    parser.add_argument(
        "--freed-cache",
        type=int,
        default=workload.DEFAULT_FREED_CACHE,
        metavar="N",
        help=f"freed addresses remembered before their index is recycled (default {workload.DEFAULT_FREED_CACHE})",
    )
    parser.add_argument("--tmpdir", help="directory for the spooled thread streams")
    parser.add_argument(
        "--max-warnings",
        type=int,
        default=20,
        metavar="N",
        help="per-record warnings printed (default 20; the summary counts all)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    if args.output != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise PymtraceError(f"output directory of {args.output} does not exist")
    stats, counts = workload.convert_file(
        args.trace,
        args.output,
        force=args.force,
        compat=args.upstream_compat,
        freed_cache=args.freed_cache,
        tmpdir=args.tmpdir,
        progress=args.progress,
        max_warnings=args.max_warnings,
        valloc_as_memalign=args.for_trace_run,
    )
    dest = sys.stderr if args.output == "-" else sys.stdout
    extra = []
    for key in (
        "inversions_fixed",
        "inversions_unrepaired",
        "invalid_frees",
        "null_results",
        "unknown_reallocs",
        "forgotten_addresses",
    ):
        if stats[key]:
            extra.append(f"{key.replace('_', ' ')} {stats[key]}")
    print(
        f"{args.output}: {stats['records']} calls, {stats['threads']} threads, {stats['syncs']} syncs, "
        f"{stats['pointer_slots']} pointer slots, {stats['bytes']} bytes, "
        f"ideal RSS {stats['ideal_rss_bytes']} bytes" + (" (" + ", ".join(extra) + ")" if extra else ""),
        file=dest,
    )
    return 0
