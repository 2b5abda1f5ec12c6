"""`pymtrace dump`: decode a recorded trace, like upstream trace_dump, plus per-type statistics."""

import collections
import json
import sys

from pymtrace.errors import CorruptFile
from pymtrace.trace.formats import load_records, mtrace_bin

HELP = "Decode a recorded malloc trace (mtrace-bin or mtrace-text), one call a line, with per-type statistics."
EPILOG = """\
examples:
  pymtrace dump mtrace.out.1234              # every record, then statistics
  pymtrace dump --stats mtrace.out.1234      # statistics only
  pymtrace dump --json --limit 100 trace     # machine-readable
  pymtrace dump log.txt                      # a glibc MALLOC_TRACE text log

Columns (mtrace-bin): index, thread id, call, ptr1, ptr2, size, size2, size3, time (ns,
relative to the first record), caller, path flags. ptr1 of posix_memalign is its return
code. OVERHEAD: reads the file once (twice with --json, whose statistics come first), in
bounded memory; no BPF, no root needed.
"""


def configure(parser):
    parser.add_argument("file", help="trace file (mtrace-bin, or mtrace-text starting with `= Start`)")
    parser.add_argument("--stats", action="store_true", help="statistics only")
    parser.add_argument("--limit", type=int, metavar="N", help="decode at most N records (statistics still cover all)")
    parser.add_argument("--json", action="store_true", help="JSON output")


class Stats:
    def __init__(self):
        self.count = collections.Counter()
        self.bytes = collections.Counter()
        self.failed = collections.Counter()
        self.min = {}
        self.max = {}
        self.threads = set()
        self.free_null = 0
        self.first_ts = None
        self.last_ts = None
        self.total = 0

    def add(self, r):
        name = r.type_name
        self.total += 1
        self.count[name] += 1
        self.threads.add(r.thread)
        if r.ts_ns:
            self.first_ts = r.ts_ns if self.first_ts is None else min(self.first_ts, r.ts_ns)
            self.last_ts = r.ts_ns if self.last_ts is None else max(self.last_ts, r.ts_ns)
        if r.type == mtrace_bin.FREE:
            self.free_null += r.ptr1 == 0
            return
        self.bytes[name] += r.size
        self.min[name] = min(self.min.get(name, r.size), r.size)
        self.max[name] = max(self.max.get(name, r.size), r.size)
        failed = (
            (r.ptr1 != 0)
            if r.type == mtrace_bin.POSIX_MEMALIGN
            else (r.ptr2 == 0 and not (r.type == mtrace_bin.REALLOC and r.size == 0))
        )
        self.failed[name] += failed

    def as_dict(self):
        return {
            "records": self.total,
            "threads": len(self.threads),
            "span_ns": (self.last_ts - self.first_ts) if self.first_ts is not None else None,
            "free_null": self.free_null,
            "types": {
                name: {
                    "count": self.count[name],
                    "requested_bytes": self.bytes[name],
                    "failed": self.failed[name],
                    "min_size": self.min.get(name),
                    "max_size": self.max.get(name),
                }
                for name in self.count
            },
        }


def _flags(path):
    return ",".join(n for bit, n in mtrace_bin.PATH_FLAGS.items() if path & (1 << (bit - 8)))


def _record_json(i, r):
    return {
        "index": i,
        "thread": r.thread,
        "call": r.type_name,
        "ptr1": r.ptr1,
        "ptr2": r.ptr2,
        "size": r.size,
        "size2": r.size2,
        "size3": r.size3,
        "ts_ns": r.ts_ns,
        "caller": r.caller,
        "path": _flags(r.path),
    }


def _write_json(args, fmt, st, out):
    """The JSON document, streamed: statistics come first, so the records are read again
    (a second pass over the file) instead of being held in memory."""
    doc = {"file": args.file, "format": fmt, "stats": st}
    if args.stats:
        json.dump(doc, out)
        out.write("\n")
        return
    head = json.dumps({**doc, "records": []})
    out.write(head[:-2])  # everything up to and including the records' "["
    n = st["records"] if args.limit is None else max(0, min(args.limit, st["records"]))
    _, records = load_records(args.file)
    for i, r in zip(range(n), records):
        if i:
            out.write(", ")
        out.write(json.dumps(_record_json(i, r)))
    out.write("]}\n")


def run(args):
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
                f"{r.size:10d} {r.size2:8d} {r.size3:8d} {rel:12d} {r.caller:#014x} {_flags(r.path)}\n"
            )
        st = stats.as_dict()
        if args.json:
            _write_json(args, fmt, st, out)
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
