"""`pymtrace dump`: decode a recorded trace, like upstream trace_dump, plus per-type statistics."""

import argparse
import os
import sys

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.sinks.text import printable
from pymtrace.trace import mappings, stacktable
from pymtrace.trace.formats.autodetect import load_records, recorded_allocator
from pymtrace.trace.tracestats import Stats, path_flags, write_json

_ALLOCATOR_TEXT = {"generic": "the program's own malloc"}
TOP_STACKS = 10  # --stats: the stacks listed by bytes requested

HELP = "Decode a recorded malloc trace (mtrace-bin, mtrace-text or parquet), one call a line, with per-type statistics."
EPILOG = """\
examples:
  pymtrace dump mtrace.out.1234              # every record, then statistics
  pymtrace dump --stats mtrace.out.1234      # statistics only
  pymtrace dump --json --limit 100 trace     # machine-readable
  pymtrace dump log.txt                      # a glibc MALLOC_TRACE text log
  pymtrace dump --stats app.parquet          # a Parquet recording (record --format parquet)

Columns (mtrace-bin, parquet): index, thread id, call, ptr1, ptr2, size, size2, size3, time (ns,
relative to the first record), caller, path flags (a `record --stacks` trace: stack=ID), and
for a trace that keeps its executable mappings (record) the caller's function (file:line),
from the binaries or their debug files on this machine (--json: `function`, `source`).
ptr1 of posix_memalign is its return code. A recording made with `record --stacks` has its
stack table FILE.stacks beside it: --stacks prints each allocation's frames under its line
(leaf first), and the statistics list the top stacks by bytes requested. OVERHEAD: reads the file once (twice with --json, whose statistics come first), in
bounded memory; no BPF, no root needed.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="trace file (mtrace-bin, mtrace-text starting with `= Start`, or parquet)")
    parser.add_argument("--stats", action="store_true", help="statistics only")
    parser.add_argument("--limit", type=int, metavar="N", help="decode at most N records (statistics still cover all)")
    parser.add_argument("--json", action="store_true", help="JSON output")
    parser.add_argument(
        "--stacks", action="store_true", help="print each record's call stack from FILE.stacks (record --stacks)"
    )


def frame_text(f: stacktable.StackFrame) -> str:
    """One frame as dump prints it: function (file:line) module+offset; a Python frame:
    function (file:line) [python]."""
    where = f" ({f.file}:{f.line})" if f.file else ""
    if f.python:
        return f"{f.function}{where} [python]"
    inl = " [inlined]" if f.inlined else ""
    return f"{f.function}{where} {os.path.basename(f.module)}+{f.offset:#x}{inl}"


def load_table(path: str, required: bool) -> dict[int, stacktable.Stack] | None:
    """The stack table beside the trace PATH, None if there is none (an error if REQUIRED)."""
    table = stacktable.table_path(path)
    if not os.path.exists(table):
        if required:
            raise PymtraceError(f"{path}: no stack table {table} (recorded without --stacks?)")
        return None
    return stacktable.read_table(table)


class CallerNames:
    """The function and source line of the callers of the trace PATH (format FMT) from the
    mappings it keeps; names() is falsy for a trace without them."""

    def __init__(self, path: str, fmt: str) -> None:
        from pymtrace.trace.formats import parquet

        meta = parquet.read_metadata(path) if fmt == "parquet" else None
        self.maps = mappings.load(path, fmt, meta)
        self.symbolizer = mappings.Symbolizer()

    def place(self, caller: int) -> mappings.Place | None:
        return self.symbolizer.place(self.maps, 0, caller) if self.maps is not None else None

    def json(self, r: object) -> dict:
        place = self.place(r.caller)
        if place is None:
            return {"function": None, "source": None} if self.maps is not None else {}
        return {"function": place.function, "source": f"{place.file}:{place.line}" if place.file else None}

    def note(self) -> None:
        """One line on stderr naming the recorded files not found here (their callers stay addresses)."""
        if self.symbolizer.missing:
            missing = printable(", ".join(sorted(self.symbolizer.missing)))
            print(
                f"pymtrace: note: not found on this machine, their callers stay addresses: {missing}", file=sys.stderr
            )


def run(args: argparse.Namespace) -> int:
    fmt, records = load_records(args.file)
    table = load_table(args.file, args.stacks)
    names = CallerNames(args.file, fmt)
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
            place = names.place(r.caller)
            out.write(
                f"{i:8d} {r.thread:7d} {r.type_name:<14} {r.ptr1:#014x} {r.ptr2:#014x} "
                f"{r.size:10d} {r.size2:8d} {r.size3:8d} {rel:12d} {r.caller:#014x} {path_flags(r.path)}"
                + (f"stack={r.stack}" if r.stack else "")
                + (f" {printable(place.text())}" if place else "")
                + "\n"
            )
            if args.stacks and r.stack:
                entry = table.get(r.stack)
                if entry is None:
                    raise CorruptFile(f"{args.file}: record {i} names stack {r.stack}, which the stack table lacks")
                for f in reversed(entry.frames):
                    out.write(f"           {printable(frame_text(f))}\n")
        st = stats.as_dict()
        st["allocator"] = recorded_allocator(args.file)  # recorded from (None: glibc, or not said)
        if table is not None:
            st["top_stacks"] = [
                {**t, "frames": [f.function for f in table[t["stack"]].frames] if t["stack"] in table else []}
                for t in stats.top_stacks(TOP_STACKS)
            ]
        if args.json:
            write_json(args.file, fmt, st, out, stats_only=args.stats, limit=args.limit, more=names.json)
            names.note()
            return 0
    except CorruptFile as exc:
        raise CorruptFile(str(exc)) from None
    out.write(
        f"\n{args.file}: {fmt}, {st['records']} records, {st['threads']} threads"
        + (f", {st['span_ns'] / 1e9:.6f} s" if st["span_ns"] is not None else "")
        + (f", recorded from {_ALLOCATOR_TEXT.get(st['allocator'], st['allocator'])}" if st["allocator"] else "")
        + "\n"
    )
    out.write(f"{'call':<15}{'count':>10}{'failed':>8}{'requested bytes':>22}{'min':>21}{'max':>21}\n")
    for name, t in sorted(st["types"].items(), key=lambda kv: -kv[1]["count"]):
        mn = "" if t["min_size"] is None else t["min_size"]
        mx = "" if t["max_size"] is None else t["max_size"]
        out.write(f"{name:<15}{t['count']:>10}{t['failed']:>8}{t['requested_bytes']:>22}{mn!s:>21}{mx!s:>21}\n")
    if st["free_null"]:
        out.write(f"free(NULL): {st['free_null']}\n")
    if st.get("top_stacks"):
        out.write(f"\ntop stacks by bytes requested ({len(table)} stacks in {stacktable.table_path(args.file)}):\n")
        out.write(f"{'bytes':>14}{'count':>10}{'stack':>8}  frames (root first)\n")
        for t in st["top_stacks"]:
            out.write(f"{t['bytes']:>14}{t['count']:>10}{t['stack']:>8}  {printable(';'.join(t['frames']))}\n")
    names.note()
    return 0
