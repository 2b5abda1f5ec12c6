"""`pymtrace dump`: decode a recorded trace, like upstream trace_dump, plus per-type statistics."""

import argparse
import sys

from pymtrace.errors import CorruptFile
from pymtrace.trace.formats import load_records
from pymtrace.trace.tracestats import Stats, path_flags, write_json

HELP = "Decode a recorded malloc trace (mtrace-bin, mtrace-text or parquet), one call a line, with per-type statistics."
EPILOG = """\
examples:
  pymtrace dump mtrace.out.1234              # every record, then statistics
  pymtrace dump --stats mtrace.out.1234      # statistics only
  pymtrace dump --json --limit 100 trace     # machine-readable
  pymtrace dump log.txt                      # a glibc MALLOC_TRACE text log
  pymtrace dump --stats app.parquet          # a Parquet recording (record --format parquet)

Columns (mtrace-bin, parquet): index, thread id, call, ptr1, ptr2, size, size2, size3, time (ns,
relative to the first record), caller, path flags. ptr1 of posix_memalign is its return
code. OVERHEAD: reads the file once (twice with --json, whose statistics come first), in
bounded memory; no BPF, no root needed.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="trace file (mtrace-bin, mtrace-text starting with `= Start`, or parquet)")
    parser.add_argument("--stats", action="store_true", help="statistics only")
    parser.add_argument("--limit", type=int, metavar="N", help="decode at most N records (statistics still cover all)")
    parser.add_argument("--json", action="store_true", help="JSON output")


def run(args: argparse.Namespace) -> int:
    fmt, records = load_records(args.file)
    stats = Stats()
    out = sys.stdout
    t0 = None
    try:
        for i, r in enumerate(records):
            stats.add(r)
            if args.json or args.stats or (args.limit is not None and i >= args.limit):
                continue
            if t0 is None and r.ts_ns:
                t0 = r.ts_ns
            rel = r.ts_ns - t0 if (r.ts_ns and t0 is not None) else 0
            out.write(
                f"{i:8d} {r.thread:7d} {r.type_name:<14} {r.ptr1:#014x} {r.ptr2:#014x} "
                f"{r.size:10d} {r.size2:8d} {r.size3:8d} {rel:12d} {r.caller:#014x} {path_flags(r.path)}\n"
            )
        st = stats.as_dict()
        if args.json:
            write_json(args.file, fmt, st, out, stats_only=args.stats, limit=args.limit)
            return 0
    except CorruptFile as exc:
        raise CorruptFile(str(exc)) from None
    out.write(
        f"\n{args.file}: {fmt}, {st['records']} records, {st['threads']} threads"
        + (f", {st['span_ns'] / 1e9:.6f} s" if st["span_ns"] is not None else "")
        + "\n"
    )
    out.write(f"{'call':<15}{'count':>10}{'failed':>8}{'requested bytes':>22}{'min':>21}{'max':>21}\n")
    for name, t in sorted(st["types"].items(), key=lambda kv: -kv[1]["count"]):
        mn = "" if t["min_size"] is None else t["min_size"]
        mx = "" if t["max_size"] is None else t["max_size"]
        out.write(f"{name:<15}{t['count']:>10}{t['failed']:>8}{t['requested_bytes']:>22}{mn!s:>21}{mx!s:>21}\n")
    if st["free_null"]:
        out.write(f"free(NULL): {st['free_null']}\n")
    return 0
