"""Statistics of a recorded trace and its JSON document (what `pymtrace dump` prints)."""

import collections
import json
from typing import Callable, TextIO

from pymtrace.trace.formats import mtrace_bin
from pymtrace.trace.formats.autodetect import load_records


class Stats:
    """Per-call-type statistics of a trace, added one record at a time (bounded memory)."""

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
        self.stack_count = collections.Counter()  # record --stacks: allocations per stack id
        self.stack_bytes = collections.Counter()  # bytes requested per stack id

    def add(self, r: mtrace_bin.Record) -> None:
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
        if r.stack:
            self.stack_count[r.stack] += 1
            self.stack_bytes[r.stack] += r.size
        self.min[name] = min(self.min.get(name, r.size), r.size)
        self.max[name] = max(self.max.get(name, r.size), r.size)
        failed = (
            (r.ptr1 != 0)
            if r.type == mtrace_bin.POSIX_MEMALIGN
            else (r.ptr2 == 0 and not (r.type == mtrace_bin.REALLOC and r.size == 0))
        )
        self.failed[name] += failed

    def top_stacks(self, n: int = 10) -> list[dict]:
        """The N stacks that requested the most bytes: [{"stack", "bytes", "count"}]."""
        top = sorted(self.stack_bytes.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        return [{"stack": sid, "bytes": b, "count": self.stack_count[sid]} for sid, b in top]

    def as_dict(self) -> dict:
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


def path_flags(path: int) -> str:
    """A record's path flags as names, comma-separated."""
    return ",".join(n for bit, n in mtrace_bin.PATH_FLAGS.items() if path & (1 << (bit - 8)))


def record_json(i: int, r: mtrace_bin.Record) -> dict:
    """Record number I as a JSON object."""
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
        "path": path_flags(r.path),
        **({"stack": r.stack} if r.stack else {}),
    }


def write_json(
    path: str,
    fmt: str,
    st: dict,
    out: TextIO,
    stats_only: bool = False,
    limit: int | None = None,
    more: Callable[[mtrace_bin.Record], dict] | None = None,
) -> None:
    """The JSON document of the trace PATH (format FMT, statistics ST) to OUT, streamed:
    statistics come first, so the records are read again (a second pass over the file)
    instead of being held in memory. STATS_ONLY: no records; LIMIT: at most that many;
    MORE: keys added to a record's object (its caller's function and source line)."""
    doc = {"file": path, "format": fmt, "stats": st}
    if stats_only:
        json.dump(doc, out)
        out.write("\n")
        return
    head = json.dumps({**doc, "records": []})
    out.write(head[:-2])  # everything up to and including the records' "["
    n = st["records"] if limit is None else max(0, min(limit, st["records"]))
    _, records = load_records(path)
    for i, r in zip(range(n), records):
        if i:
            out.write(", ")
        out.write(json.dumps({**record_json(i, r), **more(r)} if more else record_json(i, r)))
    out.write("]}\n")
