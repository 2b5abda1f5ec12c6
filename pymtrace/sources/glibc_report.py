"""The end-of-run report of `pymtrace run` / `pymtrace summary`: its model (Report, built from the
ProbeHits of one process, pure Python) and the Tracer that feeds it (GlibcSource with
faults, plus /proc/PID/maps samples). Rendering: pymtrace.sinks.run_report.

The report is exact for what the probes saw; the BPF map aggregates of GlibcSource are
included under "collector" as a cross-check.
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from typing import Any, Generic, Iterable, TypeVar

from pymtrace.errors import PymtraceError
from pymtrace.sources import glibc, usdt
from pymtrace.tracee import libc, proc

PAGE = os.sysconf("SC_PAGE_SIZE")
HEAP_MAX_SIZE = 64 * 1024 * 1024  # glibc 64-bit: 2 * DEFAULT_MMAP_THRESHOLD_MAX
MAP_STACK = 0x20000
RETRIES = {
    "memory_malloc_retry": "malloc",
    "memory_realloc_retry": "realloc",
    "memory_calloc_retry": "calloc",
    "memory_memalign_retry": "memalign",
    "memory_arena_retry": "arena",
}
PARAM_OF_PROBE = {v: k for k, v in usdt.PARAM_PROBES.items()}
V = TypeVar("V")  # what an AddressMap maps intervals to
REGIONS = ("[heap]", "arena heaps", "mmapped chunks", "files", "[stack]", "thread stacks", "other anonymous", "unknown")


# ---------------------------------------------------------------- the report


class AddressMap(Generic[V]):
    """Non-overlapping [start, end) -> value intervals; a new interval replaces what it
    overlaps (like mmap over an existing mapping). Lookup is a binary search."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.values: list[V] = []

    def set(self, start: int, end: int, value: V | None) -> None:
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

    def remove(self, start: int, end: int) -> None:
        self.set(start, end, None)

    def _insert(self, start: int, end: int, value: V) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.values.insert(i, value)

    def get(self, addr: int) -> tuple[int, int, V] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.ends[i]:
            return self.starts[i], self.ends[i], self.values[i]
        return None


class Report:
    """Accumulates the events of one process (glibc.ProbeHit-like objects) into a report."""

    def __init__(self, pid: int) -> None:
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
        self.mmaps: AddressMap[tuple[str, int]] = AddressMap()  # mmap/munmap events: (kind, prot)
        self.samples: AddressMap[str] = AddressMap()  # /proc/PID/maps samples: path (latest sample wins)
        self.main_arena = None
        self.fds = {}  # fd -> path, from openat

    # -- /proc/PID/maps samples, taken while the process lives
    def add_maps(self, maps: Iterable[libc.Mapping]) -> None:
        for m in maps:
            self.samples.set(m.start, m.end, m.path)
            if m.path == "[heap]":
                self.brk_lo = m.start if self.brk_lo is None else min(self.brk_lo, m.start)
                self.brk_hi = m.end if self.brk_hi is None else max(self.brk_hi, m.end)

    def _sample_region(self, addr: int) -> str | None:
        hit = self.samples.get(addr)
        return hit[2] if hit else None

    # -- events
    def add(self, ev: glibc.ProbeHit) -> None:
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
            if ev.flags & glibc.EV_FILE:
                kind = "file:" + (self.fds.get(ev.fd) or "")
            elif flags & MAP_STACK:
                kind = "thread stacks"
            elif prot == 0 and length in (HEAP_MAX_SIZE, 2 * HEAP_MAX_SIZE):
                # glibc's new_heap() reservation, known without probes too: PROT_NONE, one or
                # two HEAP_MAX_SIZE; MAP_NORESERVE up to 2.36 at least, not in Debian 13's 2.41
                kind = "arena heap"
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

    def _heap(self, addr: int, size: int) -> dict[str, Any]:
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

    def _arena(self, addr: int) -> dict[str, Any]:
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

    def _current(self, param: str) -> int | None:
        for t in reversed(self.thresholds):
            if t["param"] == param:
                return t["new"]
        return None

    def _fault(self, addr: int) -> None:
        self.fault_total += 1
        region, name = self.classify(addr)
        self.faults[region] += 1
        if region == "files":
            # named at the end: a maps sample taken later may know the file
            self.fault_files[name] = self.fault_files.get(name, 0) + 1

    def classify(self, addr: int) -> tuple[str, str | tuple[int, int] | None]:
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

    def _file_faults(self) -> dict[str, int]:
        named = {}
        for key, n in self.fault_files.items():
            if isinstance(key, tuple):
                key = self._sample_region(key[0]) or "(file unmapped before it could be named)"
            named[key] = named.get(key, 0) + n
        return dict(sorted(named.items(), key=lambda kv: -kv[1]))

    # -- output
    def result(self) -> dict[str, Any]:
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


class Tracer:
    """Trace one process: source + report + /proc/PID/maps sampling."""

    def __init__(self, pid: int, libc_path: str | None, faults: bool = True) -> None:
        self.pid = pid
        self.libc_path = libc_path
        self.report = Report(pid)
        self.status = usdt.libc_status(libc_path)
        self.source = glibc.GlibcSource(pids=[pid], libcs={pid: libc_path}, on_event=self.report.add, faults=faults)
        self.faults = faults
        self.main_arena_vaddr = None
        if self.status["probes"]:
            sym = libc.symbols(libc_path).get("main_arena")
            self.main_arena_vaddr = sym.address if sym else None
        self.started = time.monotonic()

    def attach(self) -> None:
        if not self.status["probes"]:
            print(
                f"pymtrace: {self.status['reason']}; glibc internals unavailable, reporting page faults only",
                file=sys.stderr,
            )
            if not self.faults:
                return
        self.source.attach()
        self.source.add_fault_pid(self.pid)
        for w in self.source.warnings:  # e.g. an argument whose symbol is not in the libc
            print(f"pymtrace: warning: {w}", file=sys.stderr)

    def sample(self) -> None:
        try:
            maps = libc.read_maps(self.pid)
        except (PymtraceError, OSError):
            return
        self.report.add_maps(maps)
        if self.main_arena_vaddr is not None and self.report.main_arena is None:
            bias = usdt.load_bias(self.pid, self.libc_path)
            if bias is not None:
                self.report.main_arena = bias + self.main_arena_vaddr

    def step(self) -> None:
        self.source.poll()
        self.sample()

    def finish(self, command: list[str] | None = None, exit_code: int | None = None) -> dict[str, Any]:
        self.source.poll()
        snap = self.source.snapshot() if self.source.bpf is not None else {"glibc": {}}
        lost = self.source.lost()
        self.source.close()
        g = snap["glibc"].get(self.pid, {})
        doc = {
            "warnings": list(self.source.warnings),
            "pid": self.pid,
            "command": command,
            "comm": self.report.comm or g.get("comm") or proc.comm(self.pid, missing="?"),
            "libc": self.libc_path,
            "probes": self.status["probes"],
            "reason": self.status["reason"],
            "duration_s": round(time.monotonic() - self.started, 3),
            "exit_code": exit_code,
            "lost_events": lost,
        }
        res = self.report.result()
        faults = res.pop("faults")
        alive = threads_alive(self.pid)
        for a in res["arenas"]:
            a["active_threads"] = [t for t in a["threads"] if t in alive]
        if self.status["probes"]:
            doc["glibc"] = res
            doc["collector"] = g
        doc["faults"] = faults if self.faults else None
        return doc


def threads_alive(pid: int) -> set:
    """TIDs of PID's threads alive now (none once it has exited)."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()
