"""Collectors behind `pymtrace top` and the exporter: BPF programs in, JSON-able snapshots out.

Stable API (used by pymtrace.commands.top, pymtrace.sinks.tui via top, and the Prometheus exporter):

    from pymtrace.collect.collectors import MallocCollector, SlabCollector, FaultCollector, Collectors

    c = MallocCollector(pids=None)      # None: every process; or a list of PIDs
    c.attach()                          # compile, load, attach (raises PymtraceError)
    snap = c.snapshot()                 # cheap enough to call every second
    c.close()                           # detach everything; safe to call twice

    # or all at once (one process-exit watcher shared by all collectors):
    with Collectors(pids=[1234], malloc=True, slab=True, faults=True, glibc=True) as cs:
        snap = cs.snapshot()

Every collector takes pids=None|[...] and track_exits=True (start its own cn_proc watcher to
drop the state of exited processes; the bundle passes False and feeds them exits itself via
exited(tgid)). Attributes read by attach(), settable before it: MallocCollector.max_procs,
FaultCollector.max_procs / .max_granules / .regions (False: no per-region map, no
"fault_regions"), SlabCollector.max_caches; MallocCollector(empty=True) attaches programs
that do nothing (the benchmark's floor). Collectors(...).collectors is {"malloc", "faults",
"slab", "glibc"} -> collector, for such settings. Snapshots are CUMULATIVE since attach, plus gauges; consumers compute rates from
two snapshots (pymtrace.sinks.views does). PIDs are int keys here; they become strings after
json.dumps. The snapshot's schema, typed, and the merge of the collectors' snapshots into
one: pymtrace.collect.snapshot.

Exited processes: a process that exits appears once more with "exited": True, then its
BPF state is deleted. Every map is bounded and LRU (BPF_TABLE "lru_percpu_hash" /
"lru_hash"), so 10,000 short-lived processes cannot grow memory without limit:
MallocCollector 8192 processes ("ms_stats"), FaultCollector 16384 processes ("pf_totals")
and 65536 address granules ("pf_regions"), SlabCollector 2048 cache names ("slab_stats").
When a map is full, a new key evicts the least recently used one instead of being dropped:
an evicted process disappears from the snapshots or, at its next event, comes back with
counters restarted from 0 ("evicted" counts both cases, as seen between two snapshots;
pymtrace.sinks.prometheus.Aggregator keeps its counters monotonic across them). Evicted granules
lose their per-region counts; the per-process totals are unaffected.

Probe placement (MallocCollector): uprobes on the process's libc (from /proc/PID/maps;
system-wide: the system libc plus every other libc mapped by a running process), each
entry probe at the first instruction the kernel emulates (pymtrace.target.probesite; glibc 2.36's
free goes at +9 `push %rbp` instead of +0 `test %rdi,%rdi`, which is single-stepped at ~5x
the cost, plus the early-exit `ret` that free(NULL) takes). Return probes for malloc,
calloc, realloc and the memalign family. Nested internal calls (realloc -> malloc/free,
memalign -> malloc) are not counted (see bpf/malloc_stats.bpf.c).
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pymtrace.bpf import kfeatures, structs
from pymtrace.bpf import load as bpfload
from pymtrace.collect import snapshot as snapshot_model
from pymtrace.collect.snapshot import call_names
from pymtrace.errors import NotRootError, ProcessGone, PymtraceError
from pymtrace.target import libc, probesite


def _lost_names(program, prefix):
    """{index: name} of a program's lost-event counters (#define PREFIX_LOST_<NAME> i)."""
    consts = structs.header(program).consts
    return {
        v: k[len(prefix) + len("_LOST_") :].lower()
        for k, v in consts.items()
        if k.startswith(prefix + "_LOST_") and not k.endswith("_N")
    }


# function -> (entry program, return program or None). Order matters for shared addresses
# (memalign and aligned_alloc are one function in glibc: attached once, counted as memalign).
MALLOC_PROBES = (
    ("malloc", "ms_malloc_entry", "ms_malloc_return"),
    ("calloc", "ms_calloc_entry", "ms_calloc_return"),
    ("realloc", "ms_realloc_entry", "ms_outer_return"),
    ("free", "ms_free_entry", None),
    ("memalign", "ms_memalign_entry", "ms_outer_return"),
    ("aligned_alloc", "ms_memalign_entry", "ms_outer_return"),
    ("posix_memalign", "ms_posix_memalign_entry", "ms_outer_return"),
    ("valloc", "ms_valloc_entry", "ms_outer_return"),
    ("pvalloc", "ms_pvalloc_entry", "ms_outer_return"),
)


def _check_pids(pids):
    if pids is None:
        return None
    out = []
    for pid in pids:
        pid = int(pid)
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessGone(pid)
        out.append(pid)
    return sorted(set(out))


def _struct_fields(program, name):
    return [f for f, _ in structs.header(program).structs[name]._fields_]


def _to_dict(value, fields):
    out = {}
    for f in fields:
        v = getattr(value, f)
        out[f] = list(v) if hasattr(v, "__len__") and not isinstance(v, (bytes, str)) else v
    return out


_COMM_FIELDS = ("comm", "comm_ns")


def _sum_percpu(values, fields):
    """Sum a per-CPU list of ctypes structs into one dict (array fields elementwise; the
    comm/comm_ns fields are left out: see _bpf_comm)."""
    fields = [f for f in fields if f not in _COMM_FIELDS]
    total = None
    for v in values:
        d = _to_dict(v, fields)
        if total is None:
            total = d
            continue
        for f, x in d.items():
            if isinstance(x, list):
                total[f] = [a + b for a, b in zip(total[f], x)]
            else:
                total[f] += x
    return total or {}


def _bpf_comm(values):
    """The process name the BPF program recorded in a per-CPU entry (the slot written last:
    at the entry's creation or at the process's exec), or None."""
    best = max(values, key=lambda v: v.comm_ns, default=None)
    if best is None or not best.comm_ns:
        return None
    name = bytes(best.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
    return name or None


def _percpu_items(table):
    """[(key, [per-CPU values])] of a BCC per-CPU table, tolerant of concurrent deletes."""
    out = []
    for k in list(table.keys()):
        try:
            out.append((k, table.getvalue(k)))
        except KeyError:
            continue
    return out


def _lost_counts(table, names):
    out = {}
    for idx, name in names.items():
        try:
            vals = table.getvalue(table.Key(idx))
            out[name] = int(sum(vals))
        except Exception:
            continue
    return out


def detach_parallel(bpf):
    """Detach BPF's uprobes concurrently, then everything else (bpfload.detach_all).

    Since kernel 6.x removing a uprobe waits for an RCU grace period; BCC removes them one
    after the other (~0.1-0.2 s each here, seconds for top's 17 probes on a busy machine).
    Closing the perf-event fds from threads (BCC's ctypes calls release the GIL) lets the
    grace periods overlap."""
    if bpf is None:
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from bcc import lib

        items = list(bpf.uprobe_fds.items())
        if len(items) > 1:

            def close(item):
                ev_name, fd = item
                lib.bpf_close_perf_event_fd(fd)
                lib.bpf_detach_uprobe(ev_name)  # removes a tracefs event if BCC made one

            with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
                list(pool.map(close, items))
            for ev_name, _ in items:
                bpf._del_uprobe_fd(ev_name)  # keeps BCC's open-probe count right
    except Exception:
        pass  # fall back to BCC's own sequential cleanup below
    bpfload.detach_all(bpf)


class _Comms:
    """PID -> comm, remembered so an exited process keeps its name: /proc/PID/comm while the
    process lives (its main thread's name), else the name the BPF program recorded (BPF)."""

    def __init__(self):
        self.names = {}

    def get(self, pid, refresh=False, bpf=None):
        if refresh or pid not in self.names or (self.names[pid] == "?" and bpf):
            name = libc.comm(pid)
            if name == "?" and bpf:
                name = bpf  # exited before we could read /proc: the name BPF recorded
            if name != "?" or pid not in self.names:
                self.names[pid] = name
        return self.names[pid]

    def forget(self, pid):
        self.names.pop(pid, None)


class _Evictions:
    """Entries of a per-process LRU map that the kernel evicted, as user space sees them: a
    process of the previous snapshot, not exited, whose entry is gone or whose cumulative
    count went down (evicted, then re-created by its next event)."""

    def __init__(self):
        self.prev = {}  # pid -> cumulative activity at the previous snapshot
        self.count = 0

    def update(self, activity, gone):
        """ACTIVITY: {pid: cumulative count} of this snapshot; GONE: pids reported exited now."""
        for pid, before in self.prev.items():
            now = activity.get(pid)
            if now is None:
                if os.path.exists(f"/proc/{pid}"):
                    self.count += 1
            elif now < before:
                self.count += 1
        self.prev = {pid: n for pid, n in activity.items() if pid not in gone}

    def info(self, entries, max_entries):
        return {"entries": entries, "max_entries": max_entries, "evicted": self.count}


def _watch_exits(on_event):
    """A started cn_proc watcher calling ON_EVENT with exit and exec events."""
    from pymtrace.target.procevents import ProcEvents

    return ProcEvents(on_event=on_event, kinds=("exit", "exec")).start()


def _process_exit(ev):
    """EV is the exit of a process (its thread-group leader), not of one of its threads."""
    return ev.kind == "exit" and ev.pid == ev.tgid


class _Collector:
    program = None  # bpf/<program>.bpf.c
    what = None  # what the program does, for errors ("tracing ...")

    def __init__(self, pids=None, track_exits=True):
        self.pids = _check_pids(pids)
        self.track_exits = track_exits
        self.bpf = None
        self.owns_bpf = False  # False: the module is shared (Collectors compiled it) and closed by its owner
        self.prepared = False
        self.start = None
        self._events = None
        self._exited = set()  # tgids seen exiting, reported once more then dropped
        self._lock = threading.Lock()
        self.comms = _Comms()

    # -- lifecycle
    def part(self):
        """The bpfload.Part this collector's program is compiled from (read by attach())."""
        return bpfload.Part(self.program, self._defines())

    def _defines(self):
        return {}

    def prepare(self):
        """Before the compile: find what to attach to (errors before seconds of compiling)."""
        self.prepared = True

    def plan(self):
        """Work that can run while the compile does (Collectors runs it in parallel)."""

    def attach(self, bpf=None):
        """Compile, load, attach. BPF: a module compiled with part() among others
        (Collectors: one compile for all), left for its owner to close; None: compile here."""
        self.start = time.monotonic()
        for pid in self.pids or ():
            self.comms.get(pid)  # remembered in case it exits before its first snapshot
        try:
            if not self.prepared:
                self.prepare()
                self.plan()
            if bpf is None:
                bpf = bpfload.load_parts([self.part()], what=self.what)
                self.owns_bpf = True
            self.bpf = bpf
            self._attach()
            if self.track_exits:
                self._events = _watch_exits(self._on_event)
        except BaseException:
            self.close()
            raise
        return self

    def _on_event(self, ev):
        if _process_exit(ev):
            self.exited(ev.tgid)
        elif ev.kind == "exec":
            self.comms.forget(ev.tgid)

    def exited(self, tgid):
        """Tell the collector TGID exited: reported once more (exited=True), then dropped."""
        with self._lock:
            self._exited.add(tgid)

    def _take_exited(self, present=()):
        """TGIDs to report as exited now: exit events seen, plus PIDS in PRESENT that no
        longer exist (events lost in a fork storm, or exits before the watcher started)."""
        with self._lock:
            gone, self._exited = self._exited, set()
        gone |= {pid for pid in present if not os.path.exists(f"/proc/{pid}")}
        return gone

    def close(self):
        if self._events is not None:
            self._events.stop()
            self._events = None
        if self.owns_bpf:
            detach_parallel(self.bpf)
        self.bpf = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.close()

    def _delete(self, table, key):
        try:
            del table[key]
        except KeyError:
            pass


def probe_plan(path):
    """top's uprobes on the libc at PATH: [(function, [(kind, offset, bpf_function), ...])].

    Entry probes go where pymtrace.target.probesite finds an emulated instruction (plus the
    early-exit side paths it proves, e.g. free(NULL)); functions sharing an address
    (memalign and aligned_alloc) are probed once. The benchmark's floor uses this too.
    """
    plan, done = [], set()
    syms = libc.symbols(path)
    for function, entry, ret in MALLOC_PROBES:
        sym = syms.get(function)
        if sym is None or sym.address in done:
            continue
        done.add(sym.address)
        sites = probesite.sites(path, function)
        probes = [("entry", off, entry) for off in (sites.offset,) + tuple(sites.side_paths)]
        if ret:
            probes.append(("return", 0, ret))
        plan.append((function, probes))
    return plan


class MallocCollector(_Collector):
    """Per-process malloc-API counters from uprobes on each process's libc."""

    program = "malloc_stats"
    what = "tracing malloc calls"

    def __init__(self, pids=None, track_exits=True, max_procs=8192, empty=False):
        super().__init__(pids, track_exits)
        self.max_procs = max_procs
        self.empty = empty  # benchmark floor: same probes, programs that do nothing
        self.attached = []  # (path, function, offset, kind, pid)
        self.libcs = {}  # libc path -> [pids] (or [-1] for every process)
        self.skipped = []  # system-wide: (path, {pid, ...}, reason) of libc files not traced
        self.fields = _struct_fields(self.program, "ms_stats")
        self.call_names = call_names()
        self.evictions = _Evictions()

    def _targets(self):
        """{libc path: [pid, ...] or [-1]}, one path per distinct file (dev, inode)."""
        targets = {}
        if self.pids is not None:
            for pid in self.pids:
                path = libc.process_libc(pid)
                if path is None:
                    raise PymtraceError(f"process {pid} maps no libc (static binary?): cannot trace its malloc calls")
                targets.setdefault(path, []).append(pid)
            return targets
        for path, users in libc.distinct_libcs(self.skipped):
            try:
                probe_plan(path)  # one unusable file must not stop the others (any user can map one)
            except Exception as exc:
                self.skipped.append((path, users, str(exc)))
                continue
            targets[path] = [-1]
        if not targets:
            raise PymtraceError("found no libc to attach to")
        return targets

    def _defines(self):
        return {"MS_MAX_PROCS": self.max_procs, "MS_EMPTY": int(self.empty)}

    def prepare(self):
        self.libcs = self._targets()
        super().prepare()

    def plan(self):
        self.plans = {path: probe_plan(path) for path in self.libcs}  # decoding libc: ~0.1-0.3 s

    def _attach(self):
        self.bpf.attach_tracepoint(tp=b"sched:sched_process_exec", fn_name=b"ms_exec")
        for path, pids in self.libcs.items():
            for pid in pids:
                self._attach_libc(path, pid)

    def _attach_libc(self, path, pid):
        for function, probes in self.plans[path]:
            try:
                for kind, off, fn_name in probes:
                    if kind == "entry":
                        self.bpf.attach_uprobe(
                            name=os.fsencode(path),
                            sym=function.encode(),
                            sym_off=off,
                            fn_name=fn_name.encode(),
                            pid=pid,
                        )
                    else:
                        self.bpf.attach_uretprobe(
                            name=os.fsencode(path), sym=function.encode(), fn_name=fn_name.encode(), pid=pid
                        )
                    self.attached.append((path, function, off, kind, pid))
            except Exception as exc:
                if pid != -1 and not os.path.exists(f"/proc/{pid}"):
                    raise ProcessGone(pid) from None
                raise PymtraceError(f"cannot attach uprobe to {function} in {path}: {exc}") from None

    def snapshot(self):
        now = time.monotonic()
        table = self.bpf[b"ms_stats"]
        items = _percpu_items(table)
        gone = self._take_exited(int(k.value) for k, _ in items)
        procs = {}
        for key, values in items:
            pid = int(key.value)
            s = _sum_percpu(values, self.fields)
            calls = s["calls"]
            procs[pid] = {
                "pid": pid,
                "comm": self.comms.get(pid, bpf=_bpf_comm(values)),
                "calls": {name: int(calls[i]) for i, name in self.call_names.items()},
                "requested_bytes": int(s["requested_bytes"]),
                "allocated_bytes": int(s["allocated_bytes"]),
                "freed_bytes": int(s["freed_bytes"]),
                "live_bytes": int(s["allocated_bytes"]) - int(s["freed_bytes"]),
                "failed": int(s["failed"]),
                "size_log2": [int(x) for x in s["size_log2"]],
                "exited": pid in gone,
            }
        for pid in gone:
            self._delete(table, table.Key(pid))
            self.comms.forget(pid)
        self.evictions.update({pid: sum(p["calls"].values()) for pid, p in procs.items()}, gone)
        lost = _lost_counts(
            self.bpf[b"ms_lost"], {i: "malloc_" + n for i, n in _lost_names("malloc_stats", "MS").items()}
        )
        maps = {"ms_stats": self.evictions.info(len(items), self.max_procs)}
        return {"time": now, "start": self.start, "processes": procs, "lost": lost, "maps": maps}


class SlabCollector(_Collector):
    """Per-cache slab counters from kmem:kmem_cache_alloc/free (system-wide).

    How caches are identified depends on the kernel (pymtrace.bpf.kfeatures.slab_source(), read
    from the tracepoints' format files in prepare()): by the `name` field where the
    tracepoints have it; otherwise allocations are keyed by object size, under the key
    "size N", whose value also lists the caches of that size from /proc/slabinfo
    ("caches": [...]), and frees (by name, when kmem_cache_free has it) are added to the row
    of their cache's size (a cache /proc/slabinfo no longer lists keeps a row of its own).
    The snapshot says which: "slab_source" (kfeatures.SLAB_BY_NAME / SLAB_BY_SIZE)."""

    program = "slab"
    what = "tracing slab caches"

    def __init__(self, pids=None, track_exits=False, max_caches=2048):
        super().__init__(None, False)  # slab activity is not attributed to processes
        self.max_caches = max_caches
        self.fields = _struct_fields(self.program, "slab_stats")
        self.source = None

    def prepare(self):
        self.source = kfeatures.slab_source()  # PymtraceError: this kernel cannot do it at all
        super().prepare()

    def _defines(self):
        if self.source is None:
            self.source = kfeatures.slab_source()
        return {"SLAB_MAX_CACHES": self.max_caches, **self.source.defines()}

    def _attach(self):
        pass  # tracepoints only: attached by BCC when the module is loaded

    def snapshot(self):
        now = time.monotonic()
        caches = {}
        by_size = self.source.source == kfeatures.SLAB_BY_SIZE
        sizes = kfeatures.slab_sizes() if by_size else {}
        fields = self.fields if self.source.frees else [f for f in self.fields if f != "frees"]
        for key, values in _percpu_items(self.bpf[b"slab_stats"]):
            name = bytes(key.name).split(b"\0", 1)[0].decode("utf-8", "replace")
            s = _sum_percpu(values, self.fields)
            if by_size:  # allocations come keyed by size, frees by name
                size = int(key.size) if not name else sizes.get(name)
                name = kfeatures.size_key(size) if size is not None else name
            row = caches.setdefault(name, dict.fromkeys(fields, 0))
            for f in fields:
                row[f] += int(s[f])
        if by_size:
            names = {}
            for cache, size in sorted(sizes.items()):
                names.setdefault(kfeatures.size_key(size), []).append(cache)
            for key, row in caches.items():
                row["caches"] = names.get(key, [])
        lost = _lost_counts(self.bpf[b"slab_lost"], {i: "slab_" + n for i, n in _lost_names("slab", "SLAB").items()})
        maps = {"slab_stats": {"entries": len(caches), "max_entries": self.max_caches}}
        snap = {
            "time": now,
            "start": self.start,
            "slab": caches,
            "slab_source": self.source.source,
            "lost": lost,
            "maps": maps,
        }
        if by_size or not self.source.frees:
            snap["slab_note"] = self.source.detail  # what the fallback in use means, for the view
        return snap


def region_label(mapping):
    if mapping is None:
        return "[unmapped]"
    if not mapping.path:
        return "[anon]"
    if mapping.path.startswith("[stack"):
        return "[stack]"
    return mapping.path


def _find(maps, address):
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


class FaultCollector(_Collector):
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

    def __init__(self, pids=None, track_exits=True, max_procs=16384, max_granules=65536, regions=True):
        super().__init__(pids, track_exits)
        self.max_procs = max_procs
        self.max_granules = max_granules
        self.regions = regions
        self.fields = _struct_fields(self.program, "pf_totals")
        self.evictions = _Evictions()
        self._regions_entries = 0
        self._region_entries = {}  # pid -> [(granule, last address, count)] read by _read_regions
        self._maps = {}  # pid -> last readable /proc/PID/maps (sorted), for processes that exited
        self._labels = {}  # (pid, granule) -> region label when the granule was first hit
        self._pending = []  # (pid, address) of new granules, from the ring buffer callback
        self._maps_lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = None
        self.maps_reads = 0  # /proc/PID/maps reads made for new granules (cost, for tests/bench)
        self._shift = structs.header(self.program).consts["PF_GRANULE_SHIFT"]

    def prepare(self):
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

    def _attach(self):
        if self.pids is not None:
            targets = self.bpf[b"pf_targets"]
            for pid in self.pids:
                targets[targets.Key(pid)] = targets.Leaf(1)
        if self.regions:
            import ctypes

            event = structs.header(self.program).structs["pf_new_granule"]
            pending = self._pending

            def on_new(ctx, data, size):
                ev = ctypes.cast(data, ctypes.POINTER(event)).contents
                pending.append((int(ev.tgid), int(ev.address)))
                return 0

            self._on_new = on_new  # BCC keeps only a ctypes wrapper: keep the function alive
            self.bpf[b"pf_new"].open_ring_buffer(on_new)
            self._stop.clear()
            self._reader = threading.Thread(target=self._read_new_granules, name="pymtrace-fault-regions", daemon=True)
            self._reader.start()

    def _read_new_granules(self):
        while not self._stop.is_set():
            try:
                self.bpf.ring_buffer_poll(self.poll_ms)  # woken by the first record of a burst
                self.bpf.ring_buffer_consume()  # records sent without a wake-up (rationed)
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.2)
                continue
            if self._pending:
                batch, self._pending[:] = list(self._pending), []
                self._label_new(batch)

    def _label_new(self, batch):
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
                except Exception:
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

    def _on_event(self, ev):
        super()._on_event(ev)
        if ev.kind == "exec":  # a new address space: its cached maps are no use
            with self._maps_lock:
                self._maps.pop(ev.tgid, None)

    def _read_regions(self):
        table = self.bpf[b"pf_regions"]
        with self._maps_lock:
            known_before = set(self._labels)
        try:
            items = list(table.items_lookup_batch())
        except Exception:
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
            except Exception:
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

    def close(self):
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None
        super().close()

    def snapshot(self):
        now = time.monotonic()
        totals = self.bpf[b"pf_totals"]
        items = _percpu_items(totals)
        gone = self._take_exited(int(k.value) for k, _ in items)
        procs = {}
        for key, values in items:
            pid = int(key.value)
            s = _sum_percpu(values, self.fields)
            procs[pid] = {
                "pid": pid,
                "comm": self.comms.get(pid, bpf=_bpf_comm(values)),
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
        lost = _lost_counts(self.bpf[b"pf_lost"], {i: "fault_" + n for i, n in _lost_names("faults", "PF").items()})
        maps = {"pf_totals": self.evictions.info(len(items), self.max_procs)}
        if self.regions:
            maps["pf_regions"] = {"entries": self._regions_entries, "max_entries": self.max_granules}
        snap = {"time": now, "start": self.start, "processes": procs, "lost": lost, "maps": maps}
        if self.regions:
            snap["fault_regions"] = regions
        return snap


def _glibc_collector_class():
    try:
        from pymtrace.collect.usdt import GlibcCollector
    except Exception:
        return None
    return GlibcCollector


class Collectors:
    """The collectors top runs, attached together, with one merged snapshot and one
    process-exit watcher; their programs are compiled as ONE BCC module (attach()).
    glibc=True adds pymtrace.collect.usdt.GlibcCollector when that module exists (its failures are
    reported in snapshot["errors"]["glibc"], not raised). Likewise slab and faults when this
    kernel cannot run them (snapshot["errors"][name]); malloc's failures are raised."""

    def __init__(self, pids=None, malloc=True, slab=True, faults=True, glibc=True, track_exits=True):
        self.pids = _check_pids(pids)
        self.collectors = {}
        self.errors = {}
        self.notes = []  # lines to show once (libc files left out of a system-wide attach)
        self.allocators = libc.AllocatorCache()
        self.track_exits = track_exits
        self._events = None
        self.start = None
        self.bpf = None  # the one BCC module of every collector
        if malloc:
            self.collectors["malloc"] = MallocCollector(self.pids, track_exits=False)
        if faults:
            self.collectors["faults"] = FaultCollector(self.pids, track_exits=False)
        if slab:
            self.collectors["slab"] = SlabCollector()
        self.want_glibc = glibc

    def attach(self):
        """One BCC compile for every collector's program, made before any uprobe is attached
        (a compile under top's malloc uprobes runs ~10x slower: BCC's clang is one of the
        processes they trap), while the malloc collector decodes its libcs. Then slab,
        faults and glibc attach, and the per-call malloc uprobes last."""
        self.start = time.monotonic()
        compiling = None
        try:
            self._prepare_own()
            own = list(self.collectors.values())
            glibc = self._prepare_glibc()
            parts = [c.part() for c in own] + ([glibc.compiled] if glibc is not None else [])
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pymtrace-bpf-compile")
            compiling = pool.submit(self._compile, parts, glibc)  # BCC's C++ releases the GIL
            pool.shutdown(wait=False)
            for c in own:
                c.plan()
            self.bpf, compiling = compiling.result(), None
            if glibc is not None and "glibc" not in self.errors and self._glibc_step(glibc.attach, self.bpf):
                self.collectors["glibc"] = glibc
            own = [c for c in own if c in self.collectors.values()]  # those that compiled
            for c in sorted(own, key=lambda c: isinstance(c, MallocCollector)):
                c.attach(self.bpf)
            if self.track_exits:
                self._events = _watch_exits(self._on_event)
        except BaseException:
            if compiling is not None:  # failed while compiling: the module is closed below
                try:
                    self.bpf = compiling.result()
                except BaseException:
                    pass
            self.close()
            raise
        note = libc.skipped_note(getattr(self.collectors.get("malloc"), "skipped", None))
        if note:
            self.notes.append(note)
        return self

    def _prepare_glibc(self):
        """The GlibcCollector to compile with the others, or None (not wanted, no libc with
        probes: nothing to compile; reasons in self.errors)."""
        if not self.want_glibc:
            return None
        cls = _glibc_collector_class()
        if cls is None:
            self.errors["glibc"] = "glibc USDT collector (pymtrace.collect.usdt) not available"
            return None
        g = self._glibc_step(cls, self.pids)  # aggregates only: no ring buffer (the fault reader polls the module's)
        if g is None or self._glibc_step(g.prepare) is None:
            if g is not None and "glibc" not in self.errors:
                self.collectors["glibc"] = g  # nothing to compile: it reports why (view 4)
            return None
        return g

    def _glibc_step(self, step, *args):
        """STEP(*ARGS) of the glibc collector; its failures go to errors["glibc"] (None returned)."""
        try:
            return step(*args)
        except PymtraceError as exc:
            self.errors["glibc"] = str(exc)
        except Exception as exc:  # its bugs must not take top down
            self.errors["glibc"] = f"{type(exc).__name__}: {exc}"
        return None

    def _prepare_own(self):
        """prepare() each collector; slab and faults that cannot work on this kernel (e.g. a
        missing tracepoint) are dropped with the reason in errors[name], the rest go on."""
        for name, c in list(self.collectors.items()):
            try:
                c.prepare()
            except (ProcessGone, NotRootError):
                raise
            except PymtraceError as exc:
                if name == "malloc":
                    raise
                self.errors[name] = str(exc)
                del self.collectors[name]

    def _compile(self, parts, glibc):
        if not parts:
            return None
        what = "tracing memory allocations"
        try:
            return bpfload.load_parts(parts, what=what)
        except NotRootError:
            raise
        except PymtraceError as exc:
            if len(parts) == 1:
                if glibc is None:
                    raise
                self.errors["glibc"] = str(exc)
                return None
            first = exc
        # One program this kernel cannot compile (a tracepoint field, a map type it lacks)
        # must not take the others down: compile each alone to find it (a second try only
        # on this failure path), drop it with the reason in errors[...], compile the rest.
        owners = {c.program: name for name, c in self.collectors.items() if isinstance(c, _Collector)}
        keep = []
        for part in parts:
            name = "glibc" if glibc is not None and part is glibc.compiled else owners.get(part.program, part.program)
            try:
                bpfload.detach_all(bpfload.load_parts([part], what=what))
            except PymtraceError as exc:
                if name == "malloc":  # what top is for: not a view to leave empty
                    raise
                self.errors[name] = str(exc)
                self.collectors.pop(name, None)
                continue
            keep.append(part)
        if not keep:
            raise first
        return bpfload.load_parts(keep, what=what)

    def _on_event(self, ev):
        for c in self.collectors.values():
            if isinstance(c, _Collector):
                c._on_event(ev)
            elif _process_exit(ev) and hasattr(c, "exited"):
                try:
                    c.exited(ev.tgid)
                except Exception:
                    pass

    def exited(self, tgid):
        for c in self.collectors.values():
            if hasattr(c, "exited"):
                c.exited(tgid)

    def snapshot(self):
        parts = []
        for name, c in self.collectors.items():
            try:
                parts.append(c.snapshot())
            except PymtraceError:
                raise
            except Exception as exc:
                if name != "glibc":
                    raise
                self.errors["glibc"] = f"{type(exc).__name__}: {exc}"
        snap = snapshot_model.merge(parts)
        snap["start"] = self.start  # the bundle's attach, before any collector's
        snap["time"] = time.monotonic()
        if "malloc" in self.collectors:  # whose malloc each process calls (not glibc's: not traced)
            self.allocators.annotate(snap["processes"], self.pids or ())
        if self.errors:
            snap["errors"] = dict(self.errors)
        return snap

    def close(self):
        if self._events is not None:
            self._events.stop()
            self._events = None
        for c in self.collectors.values():  # their threads stop; the shared module stays
            try:
                c.close()
            except Exception:
                pass
        detach_parallel(self.bpf)
        self.bpf = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.close()
