"""`pymtrace analyze`: SQL analysis of recorded traces with DuckDB: a report, JSON, HTML, or a query."""

import argparse
import json
import os
import resource
import sys

from pymtrace.errors import PymtraceError
from pymtrace.trace.files import atomic_output, check_new

HELP = (
    "Analyze one or many recorded traces (parquet directly; mtrace-bin and mtrace-text through a private "
    "temporary Parquet copy) with DuckDB, embedded: call mix, request sizes, lifetimes, live bytes over time "
    "and its peak, threads, realloc chains, top callers, allocations never freed."
)
EPILOG = """\
examples:
  pymtrace analyze app.parquet                         # the report as text
  pymtrace analyze app.parquet --html app.html         # plots and tables in one self-contained file
  pymtrace analyze 'runs/*.parquet' --json > a.json    # many traces (a glob, quoted or not), same numbers as JSON
  pymtrace analyze mtrace.out.1234 --top 20            # a binary trace (converted first)
  pymtrace analyze app.parquet --sql "SELECT type, count(*) FROM calls GROUP BY type"
  pymtrace analyze app.parquet --sql "SELECT caller, sum(size) FROM calls WHERE type='malloc' GROUP BY 1 ORDER BY 2 DESC LIMIT 5"

--sql: the view `calls` has the columns of docs/formats.md section 5 (thread, type, ptr1, ptr2,
size, size2, size3, time_ns, caller, path, stack) plus `file` (the input's index, 0 first); the
query can read the traces and nothing else, and write no file. A query DuckDB rejects is one
line and exit status 2. Output: tab-separated with a header line, or --json (a list of objects).
MEMORY: DuckDB keeps under --memory-limit and spills to a private directory under --temp-dir
(removed at exit), so traces larger than RAM work; the spill can need disk space of the order
of the trace's uncompressed size. OVERHEAD: no BPF, no root.
"""


def _within_address_space() -> None:
    """Under an address-space limit (RLIMIT_AS, `ulimit -v`), before numpy and pyarrow load:
    pyarrow's default allocator (mimalloc) reserves up to 1 GiB of address space at its first
    allocation and numpy's OpenBLAS a buffer per CPU, which would leave DuckDB too little to
    start its threads (trace/analysis.py fits those to what is left); glibc's malloc and one
    OpenBLAS thread map only what they use. A user's own setting of either is kept."""
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def configure(parser: argparse.ArgumentParser) -> None:
    _within_address_space()  # before the imports below load numpy and pyarrow
    try:
        from pymtrace.trace.analysis import DEFAULT_MEMORY_LIMIT
    except (ImportError, MemoryError) as exc:  # under an address-space limit: a library not mapped
        why = (str(exc).strip().splitlines() or ["out of memory"])[-1]  # numpy's own: its last line
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit = "" if soft == resource.RLIM_INFINITY else f" within the address-space limit ({soft >> 20} MiB)"
        parser.exit(1, f"pymtrace: error: cannot load analyze's libraries{limit}: {why}\n")
    from pymtrace.trace.report_sql import MMAP_THRESHOLD

    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files, globs or directories of *.parquet")
    parser.add_argument("--html", metavar="FILE", help="write the report with plots as one self-contained HTML file")
    parser.add_argument("--json", action="store_true", help="the report (or --sql's rows) as JSON on stdout")
    parser.add_argument("--sql", metavar="QUERY", help="run QUERY over the view `calls` instead of the report")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="rows in each top list (default 10)")
    parser.add_argument(
        "--force", action="store_true", help="replace the --html FILE if it exists (never through a symlink)"
    )
    parser.add_argument(
        "--memory-limit",
        default=DEFAULT_MEMORY_LIMIT,
        metavar="SIZE",
        help=f"DuckDB's memory limit, e.g. 512MB, 4GB (default {DEFAULT_MEMORY_LIMIT}); beyond it DuckDB spills to disk",
    )
    parser.add_argument("--threads", type=int, metavar="N", help="DuckDB worker threads (default: one per CPU)")
    parser.add_argument(
        "--temp-dir", metavar="DIR", help="where the private working directory goes (default $TMPDIR or /tmp)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=MMAP_THRESHOLD,
        metavar="BYTES",
        help=f"the request size the report splits at (default {MMAP_THRESHOLD}, glibc's M_MMAP_THRESHOLD)",
    )


def run(args: argparse.Namespace) -> int:
    from pymtrace.trace.analysis import TraceSet

    if args.top < 1:
        raise PymtraceError("--top must be at least 1")
    if args.sql and args.html:
        raise PymtraceError("--sql and --html do not go together")
    if args.html:
        check_new(args.html, args.force)  # before a long analysis
    with TraceSet(args.traces, memory_limit=args.memory_limit, threads=args.threads, temp_dir=args.temp_dir) as ts:
        if args.sql:
            columns, rows = ts.query(args.sql)
            _print_rows(columns, rows, args.json)
            return 0
        rep = ts.report(top=args.top, mmap_threshold=args.mmap_threshold)
    if args.html:
        from pymtrace.sinks.analysis_html import write_html

        with atomic_output(args.html, args.force, "w", encoding="utf-8") as out:
            write_html(rep, out, title="pymtrace analyze: " + ", ".join(args.traces))
    if args.json:
        json.dump(rep.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from pymtrace.sinks.analysis_text import write_text

        write_text(rep, sys.stdout)
    return 0


def _jsonable(v: object) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def _print_rows(columns: list, rows: list, as_json: bool) -> None:
    out = sys.stdout
    if as_json:
        json.dump([dict(zip(columns, map(_jsonable, r))) for r in rows], out, indent=1)
        out.write("\n")
        return
    out.write("\t".join(columns) + "\n")
    for r in rows:
        out.write("\t".join("" if v is None else str(v) for v in r) + "\n")
