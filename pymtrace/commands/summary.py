"""`pymtrace run -- CMD` and `pymtrace summary -p PID`: a report of glibc allocator internals.

Both trace one process through glibc's malloc USDT probes (pymtrace.collect.usdt) plus its user
page faults, mmap/munmap and brk (tracepoints), then print at its exit (run) or on
Ctrl-C (summary): arena lock waits per thread, arenas and the threads that used them,
heaps and their sizes, sbrk growth and trims, the mmap/trim threshold history with the
cause of every change, retries, tcache double-free scans, and where the page faults
happened ([heap], arena heaps, mmapped chunks, files, stacks).

The report is built from the event stream by `Report` (pure Python, no BPF), so it is
exact for what the probes saw; the BPF map aggregates of GlibcCollector are included
under "collector" as a cross-check.
"""

import bisect
import json
import os
import sys
import time

from pymtrace.bpf import load as bpfload
from pymtrace.collect import usdt
from pymtrace.errors import PymtraceError
from pymtrace.sinks.text import human_bytes
from pymtrace.target import launch, libc

HELP_RUN = """Run a command and report glibc's allocator internals when it exits: arena lock
waits per thread, arenas and the threads that used them, heaps and their sizes, total
sbrk growth and trims, every mmap/trim threshold change with its cause (mallopt,
GLIBC_TUNABLES tunable, or the dynamic threshold raised by freeing an mmapped chunk),
retries after allocation failures, tcache double-free scans, and where the process
page-faulted ([heap], arena heaps, mmapped chunks, files, stacks).

The data comes from glibc's malloc USDT probes in the libc the command really loads; if
that libc has none (Debian, Alpine), the report says so and still shows the faults."""

HELP_SUMMARY = """Attach to a running process and, on Ctrl-C (or when it exits), report glibc's
allocator internals seen meanwhile: arena lock waits per thread, arenas and their
threads, heaps, sbrk growth and trims, threshold changes with their cause, retries,
tcache double-free scans and page faults per region. Same report as `pymtrace run`."""

EPILOG_RUN = """examples:
  pymtrace run -- ./myprog args
  pymtrace run --json -o report.json -- ./myprog   # -o: the program's own stdout stays apart
  GLIBC_TUNABLES=glibc.malloc.arena_max=2 pymtrace run -- ./threaded
  pymtrace run -- ld-linux-x86-64.so.2 --library-path /opt/glibc-sdt ./myprog   # libc with probes

OVERHEAD: the malloc probes fire on slow paths only (no per-call cost). Page faults are
traced too: each user page fault of the process is one ring-buffer event, which pymtrace
decodes in Python (~3.5 us of its CPU per fault). Measured on a busy 2-core machine, a
loop touching 512 MiB of fresh pages took 3-7 us per fault traced instead of ~1.7 us.
Use --no-faults for fault-heavy programs where that matters.

EXIT STATUS: the command's own (128 + N if a signal N killed it); 1 on a pymtrace error."""

EPILOG_SUMMARY = """examples:
  pymtrace summary -p 1234            # Ctrl-C to stop and print the report
  pymtrace summary -p 1234 -d 30 --json

OVERHEAD: as for `pymtrace run`: malloc probes on slow paths only; page faults of the
process cost one event each (--no-faults to turn them off)."""

HELP = HELP_RUN
EPILOG = EPILOG_RUN

PAGE = os.sysconf("SC_PAGE_SIZE")
HEAP_MAX_SIZE = 64 * 1024 * 1024  # glibc 64-bit: 2 * DEFAULT_MMAP_THRESHOLD_MAX
MAP_STACK = 0x20000
MAP_NORESERVE = 0x4000
RETRIES = {
    "memory_malloc_retry": "malloc",
    "memory_realloc_retry": "realloc",
    "memory_calloc_retry": "calloc",
    "memory_memalign_retry": "memalign",
    "memory_arena_retry": "arena",
}
PARAM_OF_PROBE = {v: k for k, v in usdt.PARAM_PROBES.items()}
REGIONS = ("[heap]", "arena heaps", "mmapped chunks", "files", "[stack]", "thread stacks", "other anonymous", "unknown")


# ---------------------------------------------------------------- the report


class AddressMap:
    """Non-overlapping [start, end) -> value intervals; a new interval replaces what it
    overlaps (like mmap over an existing mapping). Lookup is a binary search."""

    def __init__(self):
        self.starts, self.ends, self.values = [], [], []

    def set(self, start, end, value):
        if end <= start:
            return
        i = bisect.bisect_right(self.starts, start) - 1
        if i >= 0 and self.ends[i] > start:  # the interval before overlaps: keep its head
            head_end, tail = self.ends[i], (end, self.ends[i], self.values[i])
            self.ends[i] = start
            if head_end > end:  # ... and its tail after the new interval
                self._insert(*tail)
        i = bisect.bisect_left(self.starts, start)
        j = i
        while j < len(self.starts) and self.starts[j] < end:
            j += 1
        if j > i and self.ends[j - 1] > end:  # the last overlapped one keeps its tail
            tail = (end, self.ends[j - 1], self.values[j - 1])
        else:
            tail = None
        del self.starts[i:j], self.ends[i:j], self.values[i:j]
        if value is not None:
            self._insert(start, end, value)
        if tail is not None:
            self._insert(*tail)

    def remove(self, start, end):
        self.set(start, end, None)

    def _insert(self, start, end, value):
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.values.insert(i, value)

    def get(self, addr):
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.ends[i]:
            return self.starts[i], self.ends[i], self.values[i]
        return None


class Report:
    """Accumulates the events of one process (usdt.Event-like objects) into a report."""

    def __init__(self, pid):
        self.pid = pid
        self.t0 = None
        self.comm = None
        self.events = 0
        self.sbrk = {
            "grown_bytes": 0,
            "grow_count": 0,
            "trimmed_bytes": 0,
            "trim_count": 0,
            "failed": 0,
            "chain_breaks": 0,
        }
        self._last_brk_end = None
        self.arenas = {}  # addr -> {"created_by", "size_request", "threads": set, "waits"}
        self.thread_waits = {}  # tid -> {"waits", "arenas": set}
        self.heaps = {}  # addr -> dict
        self.heap_order = []
        self.thresholds = []
        self.retries = {k: {"count": 0, "bytes": 0} for k in RETRIES.values()}
        self.double_free = []
        self.mallopt_calls = []
        self.unknown = {}
        # faults
        self.faults = {r: 0 for r in REGIONS}
        self.fault_files = {}
        self.fault_total = 0
        self.brk_lo = None
        self.brk_hi = None
        self.mmaps = AddressMap()  # mmap/munmap events: (kind, prot)
        self.samples = AddressMap()  # /proc/PID/maps samples: path (latest sample wins)
        self.main_arena = None
        self.fds = {}  # fd -> path, from openat

    # -- /proc/PID/maps samples, taken while the process lives
    def add_maps(self, maps):
        for m in maps:
            self.samples.set(m.start, m.end, m.path)
            if m.path == "[heap]":
                self.brk_lo = m.start if self.brk_lo is None else min(self.brk_lo, m.start)
                self.brk_hi = m.end if self.brk_hi is None else max(self.brk_hi, m.end)

    def _sample_region(self, addr):
        hit = self.samples.get(addr)
        return hit[2] if hit else None

    # -- events
    def add(self, ev):
        if ev.pid != self.pid:
            return
        if self.t0 is None:
            self.t0 = ev.ts
        if ev.comm:
            self.comm = ev.comm
        name = ev.probe
        a = ev.args
        if name == "page_fault":
            self._fault(a[0])
            return
        if name == "open":
            self.fds[a[0]] = ev.path
            return
        if name == "mmap":
            addr, length, prot_flags = a
            prot, flags = prot_flags >> 32, prot_flags & 0xFFFFFFFF
            if ev.flags & 16:
                kind = "file:" + (self.fds.get(ev.fd) or "")
            elif flags & MAP_STACK:
                kind = "thread stacks"
            elif prot == 0 and flags & MAP_NORESERVE and length in (HEAP_MAX_SIZE, 2 * HEAP_MAX_SIZE):
                kind = "arena heap"  # glibc's new_heap() reservation (known without probes too)
            else:
                kind = "anon"
            self.mmaps.set(addr, addr + length, (kind, prot))
            return
        if name == "munmap":
            addr, length = a
            self.mmaps.remove(addr, addr + length)
            return
        if name == "brk":
            brk = a[0]
            self.brk_lo = brk if self.brk_lo is None else min(self.brk_lo, brk)
            self.brk_hi = brk if self.brk_hi is None else max(self.brk_hi, brk)
            return
        self.events += 1
        rel = (ev.ts - self.t0) / 1e9
        if name == "memory_sbrk_more":
            if a[0] == 0:
                self.sbrk["failed"] += 1
            else:
                if self._last_brk_end is not None and a[0] != self._last_brk_end:
                    self.sbrk["chain_breaks"] += 1
                self._last_brk_end = a[0] + a[1]
                self.sbrk["grown_bytes"] += a[1]
                self.sbrk["grow_count"] += 1
        elif name == "memory_sbrk_less":
            self.sbrk["trimmed_bytes"] += a[1]
            self.sbrk["trim_count"] += 1
            self._last_brk_end = a[0]
        elif name == "memory_arena_new":
            ar = self._arena(a[0])
            ar["created_by"] = ev.tid
            ar["size_request"] = a[1]
            ar["threads"].add(ev.tid)
        elif name in ("memory_arena_reuse", "memory_arena_reuse_free_list"):
            ar = self._arena(a[0])
            ar["threads"].add(ev.tid)
            if name == "memory_arena_reuse_free_list":
                ar["from_free_list"] += 1
        elif name == "memory_arena_reuse_wait":
            ar = self._arena(a[1])
            ar["waits"] += 1
            t = self.thread_waits.setdefault(ev.tid, {"waits": 0, "arenas": set()})
            t["waits"] += 1
            t["arenas"].add(a[1])
        elif name == "memory_heap_new":
            self.heaps[a[0]] = {
                "heap": a[0],
                "created_by": ev.tid,
                "initial_size": a[1],
                "max_size": a[1],
                "final_size": a[1],
                "grow": 0,
                "shrink": 0,
                "freed": False,
            }
            self.heap_order.append(a[0])
        elif name in ("memory_heap_more", "memory_heap_less"):
            h = self._heap(a[0], a[1])
            h["final_size"] = a[1]
            h["max_size"] = max(h["max_size"], a[1])
            h["grow" if name == "memory_heap_more" else "shrink"] += 1
        elif name == "memory_heap_free":
            h = self._heap(a[0], a[1])
            h["freed"] = True
            h["final_size"] = a[1]
        elif name in RETRIES:
            r = self.retries[RETRIES[name]]
            r["count"] += 1
            r["bytes"] += a[0] if a else 0
        elif name == "memory_tcache_double_free":
            self.double_free.append(
                {"time_s": round(rel, 6), "tid": ev.tid, "entry": a[0], "tc_idx": a[1] if len(a) > 1 else None}
            )
        elif name == "memory_mallopt":
            self.mallopt_calls.append(
                {
                    "time_s": round(rel, 6),
                    "tid": ev.tid,
                    "param": usdt.MALLOPT_PARAMS.get(a[0], str(a[0])),
                    "value": a[1],
                }
            )
        elif name == "memory_mallopt_free_dyn_thresholds":
            last = self._current("mmap_threshold")
            self.thresholds.append(
                {
                    "time_s": round(rel, 6),
                    "tid": ev.tid,
                    "param": "mmap_threshold",
                    "old": last,
                    "new": a[0],
                    "cause": "dynamic",
                    "probe": name,
                }
            )
            last = self._current("trim_threshold")
            self.thresholds.append(
                {
                    "time_s": round(rel, 6),
                    "tid": ev.tid,
                    "param": "trim_threshold",
                    "old": last,
                    "new": a[1],
                    "cause": "dynamic",
                    "probe": name,
                }
            )
        elif name in PARAM_OF_PROBE:
            old = None if 1 in ev.unreadable or len(a) < 2 else a[1]
            self.thresholds.append(
                {
                    "time_s": round(rel, 6),
                    "tid": ev.tid,
                    "param": PARAM_OF_PROBE[name],
                    "old": old,
                    "new": a[0],
                    "cause": ev.cause or "tunable",
                    "probe": name,
                }
            )
        else:
            self.unknown[name] = self.unknown.get(name, 0) + 1

    def _heap(self, addr, size):
        """The heap at ADDR; one created before attach (no memory_heap_new seen) is added
        with what is known of it: SIZE, its creator and initial size unknown."""
        h = self.heaps.get(addr)
        if h is None:
            h = self.heaps[addr] = {
                "heap": addr,
                "created_by": None,
                "initial_size": None,
                "max_size": size,
                "final_size": size,
                "grow": 0,
                "shrink": 0,
                "freed": False,
            }
            self.heap_order.append(addr)
        return h

    def _arena(self, addr):
        return self.arenas.setdefault(
            addr,
            {
                "arena": addr,
                "created_by": None,
                "size_request": None,
                "threads": set(),
                "waits": 0,
                "from_free_list": 0,
            },
        )

    def _current(self, param):
        for t in reversed(self.thresholds):
            if t["param"] == param:
                return t["new"]
        return None

    def _fault(self, addr):
        self.fault_total += 1
        region, name = self.classify(addr)
        self.faults[region] += 1
        if region == "files":
            # named at the end: a maps sample taken later may know the file
            self.fault_files[name] = self.fault_files.get(name, 0) + 1

    def classify(self, addr):
        """(region, file name or None) of a faulting address, with what is known now."""
        info = self.heaps.get(addr & ~(HEAP_MAX_SIZE - 1))  # heaps are HEAP_MAX_SIZE-aligned
        if info is not None and not info["freed"]:
            return "arena heaps", None
        if self.brk_lo is not None and self.brk_lo <= addr < max(self.brk_hi, self.brk_lo):
            return "[heap]", None
        hit = self.mmaps.get(addr)
        if hit is not None:
            start, end, (kind, prot) = hit
            if kind.startswith("file:"):
                return "files", kind[5:] or self._sample_region(addr) or (start, end)
            if kind == "thread stacks":
                return "thread stacks", None
            if kind == "arena heap":
                return "arena heaps", None
            if kind == "anon":
                return "mmapped chunks", None
        path = self._sample_region(addr)
        if path is None:
            return "unknown", None
        if path == "[heap]":
            return "[heap]", None
        if path == "[stack]":
            return "[stack]", None
        if path.startswith("/"):
            return "files", path
        return "other anonymous", None

    def _file_faults(self):
        named = {}
        for key, n in self.fault_files.items():
            if isinstance(key, tuple):
                key = self._sample_region(key[0]) or "(file unmapped before it could be named)"
            named[key] = named.get(key, 0) + n
        return dict(sorted(named.items(), key=lambda kv: -kv[1]))

    # -- output
    def result(self):
        arenas = []
        for addr, ar in sorted(self.arenas.items()):
            arenas.append(
                {
                    "arena": f"{addr:#x}",
                    "main": addr == self.main_arena,
                    "created_by": ar["created_by"],
                    "size_request": ar["size_request"],
                    "threads": sorted(ar["threads"]),
                    "waits": ar["waits"],
                    "from_free_list": ar["from_free_list"],
                }
            )
        heaps = []
        for addr in self.heap_order:
            h = dict(self.heaps[addr])
            h["heap"] = f"{addr:#x}"
            heaps.append(h)
        live = [h for h in self.heaps.values() if not h["freed"]]
        waits = [
            {"tid": tid, "waits": t["waits"], "arenas": [f"{x:#x}" for x in sorted(t["arenas"])]}
            for tid, t in sorted(self.thread_waits.items())
        ]
        final = {}
        for t in self.thresholds:
            final[t["param"]] = {"value": t["new"], "cause": t["cause"]}
        sbrk = dict(self.sbrk)
        sbrk["net_bytes"] = sbrk["grown_bytes"] - sbrk["trimmed_bytes"]
        return {
            "events": self.events,
            "arena_lock_waits": waits,
            "arena_lock_waits_total": sum(t["waits"] for t in self.thread_waits.values()),
            "arenas": arenas,
            "arenas_created": sum(1 for a in self.arenas.values() if a["created_by"] is not None),
            "heaps": heaps,
            "heap_totals": {
                "created": sum(1 for h in self.heaps.values() if h["initial_size"] is not None),
                "freed": sum(1 for h in self.heaps.values() if h["freed"]),
                "live": len(live),
                "live_bytes": sum(h["final_size"] for h in live),
            },
            "sbrk": sbrk,
            "thresholds": self.thresholds,
            "final_params": final,
            "mallopt_calls": self.mallopt_calls,
            "retries": self.retries,
            "tcache_double_free_scans": len(self.double_free),
            "tcache_double_free": [dict(d, entry=f"{d['entry']:#x}") for d in self.double_free],
            "unknown_probes": self.unknown,
            "faults": {
                "total": self.fault_total,
                "regions": dict(self.faults),
                "bytes_faulted_in_approx": self.fault_total * PAGE,
                "files": self._file_faults(),
            },
        }


# ---------------------------------------------------------------- rendering


def _fmt_bytes(n):
    """summary's layout of a byte count: one decimal, up to GiB, '-' when unknown."""
    return human_bytes(n, decimals=1, none="-", largest="GiB")


def render_text(doc):
    from tabulate import tabulate

    out = []
    head = f"pymtrace report for PID {doc['pid']} ({doc.get('comm') or '?'})"
    if doc.get("command"):
        head += f": {' '.join(doc['command'])}"
    out.append(head)
    out.append(
        f"libc: {doc.get('libc') or '?'}; traced {doc.get('duration_s', 0):.2f} s"
        + (f"; exit status {doc['exit_code']}" if doc.get("exit_code") is not None else "")
    )
    if not doc.get("probes"):
        out.append("")
        out.append(f"glibc allocator internals unavailable: {doc.get('reason')}.")
        out.append(
            "Unavailable: arenas, heaps, sbrk, thresholds, retries, tcache scans. "
            "Page faults below still come from the kernel."
        )
    else:
        r = doc["glibc"]
        out.append(f"probe events: {r['events']}; lost events: {doc.get('lost_events', 0)}")
        out.append("")
        out.append("Arena lock waits per thread")
        if r["arena_lock_waits"]:
            out.append(
                tabulate(
                    [[w["tid"], w["waits"], " ".join(w["arenas"])] for w in r["arena_lock_waits"]],
                    headers=["TID", "WAITS", "ARENAS WAITED ON"],
                )
            )
        else:
            out.append("  none")
        out.append("")
        out.append(f"Arenas (main arena + {r['arenas_created']} created)")
        if r["arenas"]:
            out.append(
                tabulate(
                    [
                        [
                            a["arena"] + (" (main)" if a["main"] else ""),
                            a["created_by"] if a["created_by"] is not None else "-",
                            a["size_request"] if a["size_request"] is not None else "-",
                            len(a["threads"]),
                            " ".join(f"{t}" + ("*" if t in a.get("active_threads", ()) else "") for t in a["threads"]),
                            a["waits"],
                        ]
                        for a in r["arenas"]
                    ],
                    headers=["ARENA", "CREATED BY", "REQUEST", "THREADS", "TIDS (* = alive at the end)", "WAITS"],
                )
            )
        else:
            out.append("  only the main arena was used")
        out.append("")
        ht = r["heap_totals"]
        out.append(
            f"Heaps of non-main arenas: {ht['created']} created, {ht['freed']} freed, "
            f"{ht['live']} live ({_fmt_bytes(ht['live_bytes'])})"
        )
        if r["heaps"]:
            out.append(
                tabulate(
                    [
                        [
                            h["heap"],
                            h["created_by"] if h["created_by"] is not None else "-",
                            h["initial_size"] if h["initial_size"] is not None else "-",
                            h["max_size"],
                            h["final_size"],
                            h["grow"],
                            h["shrink"],
                            "yes" if h["freed"] else "no",
                        ]
                        for h in r["heaps"]
                    ],
                    headers=["HEAP", "CREATED BY", "INITIAL", "MAX", "FINAL", "GROWN", "SHRUNK", "FREED"],
                )
            )
        out.append("")
        s = r["sbrk"]
        out.append("Main arena (sbrk)")
        out.append(
            tabulate(
                [
                    ["grown", s["grow_count"], s["grown_bytes"], _fmt_bytes(s["grown_bytes"])],
                    ["trimmed", s["trim_count"], s["trimmed_bytes"], _fmt_bytes(s["trimmed_bytes"])],
                    ["net", "", s["net_bytes"], _fmt_bytes(s["net_bytes"])],
                    ["failed sbrk", s["failed"], "", ""],
                ],
                headers=["", "TIMES", "BYTES", ""],
            )
        )
        out.append("")
        out.append("Threshold and parameter changes")
        if r["thresholds"]:
            out.append(
                tabulate(
                    [
                        [
                            f"{t['time_s']:.6f}",
                            t["tid"],
                            t["param"],
                            "?" if t["old"] is None else t["old"],
                            t["new"],
                            t["cause"],
                        ]
                        for t in r["thresholds"]
                    ],
                    headers=["TIME (s)", "TID", "PARAMETER", "OLD", "NEW", "CAUSE"],
                )
            )
        else:
            out.append("  none (defaults kept)")
        params = doc.get("collector", {}).get("params") or {}
        if params:
            out.append("")
            out.append("Parameters at the end")
            out.append(
                tabulate(
                    [[k, v["value"], v["cause"], v["source"]] for k, v in params.items()],
                    headers=["PARAMETER", "VALUE", "SET BY", "SOURCE"],
                )
            )
        out.append("")
        out.append("Retries after allocation failures")
        out.append(
            tabulate(
                [[k, v["count"], v["bytes"]] for k, v in r["retries"].items()],
                headers=["RETRY", "COUNT", "BYTES REQUESTED"],
            )
        )
        out.append("")
        out.append(f"tcache double-free scans: {r['tcache_double_free_scans']}")
        for d in r["tcache_double_free"][:20]:
            out.append(f"  tid {d['tid']} entry {d['entry']} tc_idx {d['tc_idx']}")
    f = doc.get("faults")
    if doc.get("lost_events"):
        out.append("")
        out.append(f"WARNING: {doc['lost_events']} events were lost (ring buffer full): the counts above are too low")
    out.append("")
    if f is None:
        out.append("Page faults: not traced (--no-faults)")
    else:
        total = f["total"] or 1
        out.append(f"Page faults: {f['total']} (~{_fmt_bytes(f['bytes_faulted_in_approx'])} faulted in)")
        out.append(
            tabulate(
                [[k, v, f"{100.0 * v / total:.1f}%"] for k, v in f["regions"].items() if v],
                headers=["REGION", "FAULTS", "SHARE"],
            )
        )
        if f["files"]:
            out.append(tabulate([[k, v] for k, v in list(f["files"].items())[:10]], headers=["FILE", "FAULTS"]))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- commands


def _common(parser):
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument("--no-faults", action="store_true", help="do not trace page faults (no fault table)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE")


def configure_run(parser):
    parser.description = HELP_RUN
    parser.epilog = EPILOG_RUN
    _common(parser)
    parser.add_argument(
        "cmd", nargs="+", metavar="CMD", help="the command (and its arguments) to run and trace, after --"
    )


def configure_summary(parser):
    parser.description = HELP_SUMMARY
    parser.epilog = EPILOG_SUMMARY
    _common(parser)
    parser.add_argument("-p", "--pid", type=int, required=True, help="the process to trace")
    parser.add_argument(
        "-d",
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: Ctrl-C or process exit)",
    )


configure = configure_run


class Tracer:
    """Trace one process: collector + report + /proc/PID/maps sampling."""

    def __init__(self, pid, libc_path, faults=True):
        self.pid = pid
        self.libc_path = libc_path
        self.report = Report(pid)
        self.status = usdt.libc_status(libc_path)
        self.collector = usdt.GlibcCollector(
            pids=[pid], libcs={pid: libc_path}, on_event=self.report.add, faults=faults
        )
        self.faults = faults
        self.main_arena_vaddr = None
        if self.status["probes"]:
            sym = libc.symbols(libc_path).get("main_arena")
            self.main_arena_vaddr = sym.address if sym else None
        self.started = time.monotonic()

    def attach(self):
        if not self.status["probes"]:
            print(
                f"pymtrace: {self.status['reason']}; glibc internals unavailable, reporting page faults only",
                file=sys.stderr,
            )
            if not self.faults:
                return
        self.collector.attach()
        self.collector.add_fault_pid(self.pid)
        for w in self.collector.warnings:  # e.g. an argument whose symbol is not in the libc
            print(f"pymtrace: warning: {w}", file=sys.stderr)

    def sample(self):
        try:
            maps = libc.read_maps(self.pid)
        except (PymtraceError, OSError):
            return
        self.report.add_maps(maps)
        if self.main_arena_vaddr is not None and self.report.main_arena is None:
            bias = usdt.load_bias(self.pid, self.libc_path)
            if bias is not None:
                self.report.main_arena = bias + self.main_arena_vaddr

    def step(self):
        self.collector.poll()
        self.sample()

    def finish(self, command=None, exit_code=None):
        self.collector.poll()
        snap = self.collector.snapshot() if self.collector.bpf is not None else {"glibc": {}}
        lost = self.collector.lost()
        self.collector.close()
        g = snap["glibc"].get(self.pid, {})
        doc = {
            "warnings": list(self.collector.warnings),
            "pid": self.pid,
            "command": command,
            "comm": self.report.comm or g.get("comm") or libc.comm(self.pid),
            "libc": self.libc_path,
            "probes": self.status["probes"],
            "reason": self.status["reason"],
            "duration_s": round(time.monotonic() - self.started, 3),
            "exit_code": exit_code,
            "lost_events": lost,
        }
        res = self.report.result()
        faults = res.pop("faults")
        alive = _threads(self.pid)
        for a in res["arenas"]:
            a["active_threads"] = [t for t in a["threads"] if t in alive]
        if self.status["probes"]:
            doc["glibc"] = res
            doc["collector"] = g
        doc["faults"] = faults if self.faults else None
        return doc


def _threads(pid):
    """TIDs of PID's threads alive now (none once it has exited)."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def _emit(doc, args):
    text = json.dumps(doc, indent=1, default=str) + "\n" if args.json else render_text(doc)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def run_run(args):
    bpfload.require_root("pymtrace run")
    launched = launch.Launched(args.cmd)
    tracer = None
    try:
        path = usdt.launched_probe_file(launched)
        tracer = Tracer(launched.pid, path, faults=not args.no_faults)
        tracer.attach()
    except BaseException:
        launched.kill()
        if tracer is not None:
            tracer.collector.close()
        raise
    tracer.sample()  # the executable, the loader and the stack, mapped by exec
    launched.resume()
    interrupted = False
    try:
        while launched.proc.poll() is None:
            tracer.step()
            time.sleep(0.05)
    except KeyboardInterrupt:
        interrupted = True
        launched.stop()  # 5 s to end by itself (Ctrl-C reached it too), then SIGTERM, SIGKILL
    code = launched.proc.wait()
    doc = tracer.finish(command=args.cmd, exit_code=code)
    doc["interrupted"] = interrupted
    _emit(doc, args)
    from pymtrace.target.proc import exit_status

    return exit_status(code)


def run_summary(args):
    bpfload.require_root("pymtrace summary")
    pid = args.pid
    path = usdt.probe_file(pid)
    tracer = Tracer(pid, path, faults=not args.no_faults)
    tracer.sample()
    try:
        tracer.attach()
    except BaseException:
        tracer.collector.close()
        raise
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        # inside the try: a Ctrl-C right after this line still produces the report
        print(f"pymtrace: tracing PID {pid}; Ctrl-C to stop and report", file=sys.stderr, flush=True)
        from pymtrace.target.proc import alive

        while alive(pid):
            tracer.step()
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    doc = tracer.finish()
    _emit(doc, args)
    return 0


run = run_run
