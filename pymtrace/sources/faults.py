"""FaultSource: page faults per process and per mapped region (exceptions tracepoints)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from pymtrace.bpf import kfeatures, structs
from pymtrace.errors import PymtraceError
from pymtrace.sources.base import (
    Evictions,
    Source,
    lost_counts,
    lost_names,
    skipped_runs,
    struct_fields,
)
from pymtrace.tracee import libc

# The programs counting faults: runs the kernel skipped are reported as lost "fault_skipped"
FAULT_PROGRAMS = ("tracepoint__exceptions__page_fault_user", "tracepoint__exceptions__page_fault_kernel")

if TYPE_CHECKING:
    from pymtrace.tracee.procevents import ProcEvent


def region_label(mapping: libc.Mapping | None) -> str:
    if mapping is None:
        return "[unmapped]"
    if not mapping.path:
        return "[anon]"
    if mapping.path.startswith("[stack"):
        return "[stack]"
    return mapping.path


def _find(maps: list[libc.Mapping], address: int) -> libc.Mapping | None:
    lo, hi = 0, len(maps)
    while lo < hi:
        mid = (lo + hi) // 2
        if maps[mid].end <= address:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(maps) and maps[lo].start <= address < maps[lo].end:
        return maps[lo]
    return None


class FaultSource(Source):
    """Page faults per process (exact) and per mapped region (from address granules).

    Regions are resolved from /proc/PID/maps at snapshot time; a granule whose region is
    gone by then (a large block freed right after its pages were touched) keeps the label
    its region had when the granule was first hit: the BPF program announces every new
    (pid, granule) key on the `pf_new` ring buffer, and a thread reads /proc/PID/maps at
    once for addresses the maps it has cached for PID do not cover (one read per PID per
    batch of records; none while a process faults inside regions it already knows). The
    BPF side wakes the thread at most once per millisecond per CPU (PF_WAKE_NS); records
    in between are read at the next wake-up or within poll_ms."""

    program = "faults"
    what = "tracing page faults"
    max_labels_factor = 2  # remembered granule labels: at most this many times max_granules
    poll_ms = 50  # the reader also consumes un-woken pf_new records at least this often

    def __init__(
        self,
        pids: Iterable[int | str] | None = None,
        track_exits: bool = True,
        max_procs: int = 16384,
        max_granules: int = 65536,
        regions: bool = True,
    ) -> None:
        super().__init__(pids, track_exits)
        self.max_procs = max_procs
        self.max_granules = max_granules
        self.regions = regions
        self.fields = struct_fields(self.program, "pf_totals")
        self.evictions = Evictions()
        self._regions_entries = 0
        self._region_entries = {}  # pid -> [(granule, last address, count)] read by _read_regions
        self._maps = {}  # pid -> last readable /proc/PID/maps (sorted), for processes that exited
        self._labels = {}  # (pid, granule) -> region label when the granule was first hit
        self._pending = []  # (pid, address) of new granules, from the ring buffer callback
        self._maps_lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = None
        self.reader_error = None  # the last failure of the ring-buffer reader thread, if any
        self.maps_reads = 0  # /proc/PID/maps reads made for new granules (cost, for tests/bench)
        self._shift = structs.header(self.program).consts["PF_GRANULE_SHIFT"]

    def prepare(self) -> None:
        for tp in ("page_fault_user", "page_fault_kernel"):
            if kfeatures.tracepoint_fields("exceptions", tp) is None:
                raise PymtraceError(
                    f"no page-fault data: this kernel has no readable exceptions:{tp} tracepoint (x86 kernels have it)"
                )
        super().prepare()

    def _defines(self):
        return {
            "PF_MAX_PROCS": self.max_procs,
            "PF_MAX_GRANULES": self.max_granules,
            "PF_FILTER": int(self.pids is not None),
            "PF_REGIONS": int(self.regions),
        }

    def _attach(self) -> None:
        if self.pids is not None:
            targets = self.bpf[b"pf_targets"]
            for pid in self.pids:
                targets[targets.Key(pid)] = targets.Leaf(1)
        if self.regions:
            event = structs.header(self.program).structs["pf_new_granule"]
            pending = self._pending

            def on_new(ctx: Any, data: Any, size: int) -> int:
                ev = ctypes.cast(data, ctypes.POINTER(event)).contents
                pending.append((int(ev.tgid), int(ev.address)))
                return 0

            self._on_new = on_new  # BCC keeps only a ctypes wrapper: keep the function alive
            self.bpf[b"pf_new"].open_ring_buffer(on_new)
            self._stop.clear()
            self._reader = threading.Thread(target=self._read_new_granules, name="pymtrace-fault-regions", daemon=True)
            self._reader.start()

    def _read_new_granules(self) -> None:
        while not self._stop.is_set():
            try:
                self.bpf.ring_buffer_poll(self.poll_ms)  # woken by the first record of a burst
                self.bpf.ring_buffer_consume()  # records sent without a wake-up (rationed)
            except Exception as exc:  # BCC raises bare Exception ("No ring buffers to poll"); None once closed
                if self._stop.is_set():
                    return
                self.reader_error = f"{type(exc).__name__}: {exc}"  # kept for the tests and a debugger
                time.sleep(0.2)
                continue
            if self._pending:
                batch, self._pending[:] = list(self._pending), []
                self._label_new(batch)

    def _label_new(self, batch: list[tuple[int, int]]) -> None:
        by_pid = {}
        for pid, address in batch:
            by_pid.setdefault(pid, []).append(address)
        for pid, addresses in by_pid.items():
            with self._maps_lock:
                maps = self._maps.get(pid)
            if maps is None or any(_find(maps, a) is None for a in addresses):
                try:
                    maps = sorted(libc.read_maps(pid), key=lambda m: m.start)
                    self.maps_reads += 1
                except PymtraceError:  # gone, or its maps unreadable: labelled at snapshot time if possible
                    maps = maps or []
                with self._maps_lock:
                    self._maps[pid] = maps
            with self._maps_lock:
                for a in addresses:
                    m = _find(maps, a)
                    if m is not None:
                        self._labels[(pid, a >> self._shift)] = region_label(m)
                excess = len(self._labels) - self.max_labels_factor * self.max_granules
                if excess > 0:  # oldest first (dict order); normally pruned by snapshot()
                    for key in list(self._labels)[:excess]:
                        del self._labels[key]

    def on_process_event(self, ev: ProcEvent) -> None:
        super().on_process_event(ev)
        if ev.kind == "exec":  # a new address space: its cached maps are no use
            with self._maps_lock:
                self._maps.pop(ev.tgid, None)

    def _read_regions(self):
        table = self.bpf[b"pf_regions"]
        with self._maps_lock:
            known_before = set(self._labels)
        try:
            items = list(table.items_lookup_batch())
        except Exception:  # BCC raises bare Exception when the kernel lacks batch lookups: read one by one
            items = list(table.items())
        self._regions_entries = len(items)
        per_pid = {}
        for k, v in items:
            per_pid.setdefault(int(k.tgid), []).append((int(k.granule), int(v.last_address), int(v.count)))
        self._region_entries = per_pid
        out = {}
        present = set()
        for pid, entries in per_pid.items():
            try:
                maps = sorted(libc.read_maps(pid), key=lambda m: m.start)
                with self._maps_lock:
                    self._maps[pid] = maps
            except PymtraceError:  # exited (or unreadable): the maps it had when last read
                with self._maps_lock:
                    maps = self._maps.get(pid, [])
            labels = {}
            with self._maps_lock:
                for granule, address, count in entries:
                    present.add((pid, granule))
                    m = _find(maps, address)
                    # mapped now: its current region; gone: the region it had when first hit
                    label = region_label(m) if m is not None else self._labels.get((pid, granule), "[unmapped]")
                    labels[label] = labels.get(label, 0) + count
            out[pid] = labels
        with self._maps_lock:  # forget granules the LRU map evicted (or that were deleted)
            for key in known_before - present:
                self._labels.pop(key, None)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None
        super().close()

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        totals = self.bpf[b"pf_totals"]
        rows, gone, entries = self._per_process(totals)
        procs = {}
        for pid, s, comm in rows:
            procs[pid] = {
                "pid": pid,
                "comm": comm,
                "faults_user": int(s["user"]),
                "faults_kernel": int(s["kernel"]),
                "exited": pid in gone,
            }
        regions = self._read_regions() if self.regions else {}
        if gone:
            for pid in gone:
                self._delete(totals, totals.Key(pid))
                self.comms.forget(pid)
            with self._maps_lock:
                for pid in gone:
                    self._maps.pop(pid, None)
                for key in [k for k in self._labels if k[0] in gone]:
                    del self._labels[key]
            if self.regions:
                table = self.bpf[b"pf_regions"]
                for pid in gone:  # the granules _read_regions just saw: no second walk of the map
                    for granule, _, _ in self._region_entries.get(pid, ()):
                        self._delete(table, table.Key(tgid=pid, granule=granule))
        self.evictions.update({pid: p["faults_user"] + p["faults_kernel"] for pid, p in procs.items()}, gone)
        lost = lost_counts(self.bpf[b"pf_lost"], {i: "fault_" + n for i, n in lost_names("faults", "PF").items()})
        skipped = skipped_runs(self.bpf, FAULT_PROGRAMS)  # faults the kernel gave no program
        if skipped is not None:
            lost["fault_skipped"] = skipped
        maps = {"pf_totals": self.evictions.info(entries, self.max_procs)}
        if self.regions:
            maps["pf_regions"] = {"entries": self._regions_entries, "max_entries": self.max_granules}
        snap = {"time": now, "start": self.start, "processes": procs, "lost": lost, "maps": maps}
        if self.regions:
            snap["fault_regions"] = regions
        return snap
