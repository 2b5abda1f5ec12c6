"""The snapshot: the one data model between the sources and every sink (top's views, its
--json output, the exporter, the tests), typed below as TypedDicts over the plain JSON-able
dicts the sources build (so `top --json` prints them as they are), and the one merge of
several sources' or sources' snapshots into one.

Snapshots are CUMULATIVE since attach, plus gauges; consumers compute rates from two
snapshots (pymtrace.sinks.views does). PIDs are int keys here; they become strings after
json.dumps (the views accept both). Keys a source does not produce are absent, never
faked, so a consumer works with whichever sources are running:

    {"time": time.monotonic() when reading began (every event before it is counted),
     "start": time.monotonic() of attach,
     "processes": {pid: {
         "pid": int, "comm": str,           # /proc/PID/comm; for a process that exited
                                            # before top read it, the name BPF recorded
                                            # (at its first event and at exec)
         "exited": bool,                    # True in the last snapshot holding a process
         # MallocSource:
         "calls": {name: count for name in CALLS},   # each public call once (names: from the
                   # BPF headers, call_names()); "free" counts every free() call, "free_null"
                   # the free(NULL) among them; "memalign" includes aligned_alloc (same
                   # function in glibc); C++: "new", "new_array", "new_nothrow",
                   # "new_aligned", "delete", "delete_array", "delete_sized",
                   # "delete_aligned" (NEW_CALLS, DELETE_CALLS: the malloc/free a new or
                   # delete makes inside is not counted again; its bytes are, on glibc)
         "requested_bytes": sizes asked for (calloc: nmemb*size; realloc: new size),
         "allocated_bytes": chunk bytes of blocks returned (malloc_usable_size + 8, or + 16
                            for mmapped chunks: the chunk header's size field),
         "freed_bytes": chunk bytes of blocks freed (free, realloc's old block),
         "live_bytes": allocated_bytes - freed_bytes (negative when blocks allocated
                       before attach are freed),
         # (for a process counted on another allocator than glibc, jemalloc, ..., whose
         # blocks have no chunk header, allocated_bytes, freed_bytes and live_bytes are
         # REQUESTED bytes of the blocks allocated since attach, each block's size kept in
         # BPF (ms_fblocks): live_bytes is then never negative; marked by
         "block_bytes": "requested",   # absent for glibc (chunk bytes)
         "failed": calls that returned NULL / an error code,
         "size_log2": [65 counts]: [0] size 0, [i] sizes in [2^(i-1), 2^i - 1],
         # MallocSource, heap efficiency (pymtrace.sources.heapefficiency; absent for a
         # process that exited or whose /proc/PID/statm cannot be read):
         "rss_bytes": resident bytes now, "rss_anon_bytes": anonymous resident bytes now
                      (/proc/PID/statm: resident - shared = status's RssAnon),
         "rss_anon_base_bytes": RssAnon when counting began (at attach; 0 for a process
                      started after it): live_bytes is compared with the growth since,
         "heap_flag": anon growth > 1.5 x max(live_bytes, 0) and > max(live_bytes, 0) + 64 MiB
                      (None: no live bytes to judge: another allocator than glibc),
         # FaultSource:
         "faults_user": faults raised in user mode,
         "faults_kernel": faults on user addresses raised in kernel mode (copy_*_user),
         # MallocSource under an overhead budget (pymtrace.sources.budget.WindowedMalloc):
         # calls, requested_bytes and size_log2 are ESTIMATES (no allocated, freed, live,
         # failed; absent before the process's first window), marked by
         "estimated": True,
         "estimate": {"windows": windows that measured the process, "error": relative 95 %
                      error of its estimates (None: no call seen), "sampled_calls": calls
                      counted in the windows' measured parts, "sampled_seconds": their
                      length, "last_window_age": seconds since its last window (None: none
                      yet), "calls_per_second": what the estimated calls grow by},
         # Sources with malloc (pymtrace.tracee.libc.AllocatorCache.annotate): whose
         # malloc the process calls; a watched process whose allocator is not counted gets
         # an entry of its own holding only pid, comm and these two
         "allocator": "glibc" | "jemalloc" | ..., "allocator_traced": bool (counted)}},
     "slab": {cache_name: {"allocs", "frees", "bytes_alloc", "bytes_req"}},   # SlabSource
     "slab_source": "tracepoint name" | "object size via /proc/slabinfo",  # SlabSource: on a
         # kernel whose kmem_cache_alloc has no cache name, "slab" is keyed "size N" and each
         # value has "caches": [names of that object size]; "frees" is absent when
         # kmem_cache_free has no name either; "slab_note": one sentence saying so
     "fault_regions": {pid: {label: user+kernel faults}},  # FaultSource with regions; label
         # is the mapped file's path, "[heap]", "[stack]", "[anon]" (anonymous mmap, incl.
         # thread stacks), another [special] name, or "[unmapped]": gone by snapshot time and
         # not seen mapped when its first fault was announced (FaultSource's docstring)
     "glibc": {pid: GlibcProcess},            # pymtrace.sources.glibc.GlibcSource, below
     "stacks": {pid: StackProcess},           # top --stacks (sources.stacksites), below
     "glibc_collector": {"lost_events": ring-buffer reserve failures, "map_full": {map: n},
                         "libcs": [{"libc", "probes", "sites", "attached", "reason"}],
                         "warnings": [str]},
     "lost": {name: count},   # events the BPF side could not record, by cause; the names
         # carry their program's prefix (malloc_, fault_, slab_, glibc_events)
     "maps": {map name: {"entries": n, "max_entries": capacity,   # fill of the bounded maps
                         "evicted": n}},   # per-process maps: LRU evictions seen
     "budget": {"max_overhead_pct", "window_seconds", "windows", "bpf_stats_windows": those
                with the kernel's BPF statistics on, "attached": bool (a window
                now), "duty_cycle": fraction of the time attached, "overhead_pct": measured
                cost over the traced processes' own CPU time (None: none yet),
                "traced_cpu_seconds", "cost_seconds": {"traps", "bpf", "attach_detach"},
                "trap_ns_per_run", "trap_spread_ns", "trap_single_step_ns" (calibrated at start:
                emulated sites and returns, single-stepped sites), "probes": "uprobe_multi
                link" | "perf-event uprobe", "errors": [str]},   # under --max-overhead only
     "errors": {source: reason},   # Sources: those that cannot run here (a kernel
         # without a tracepoint, a program it will not load; the others run), glibc's failures
     "notes": [str]}                  # top's full screen: lines to show once

GlibcSource's entry per process ("glibc": {pid: ...}):

    {"pid": int, "comm": str, "alive": bool,
     "libc": path of the libc the process maps (None: static or unknown),
     "probes": number of distinct memory_* probe names that libc carries (0: none),
     "reason": None, or why there is no data, e.g. "libc /usr/lib/x86_64-linux-gnu/
               libc.so.6 has no USDT probes (Debian builds glibc without
               --enable-systemtap)",
     # the rest only when "probes" > 0
     "events": probe hits seen for this pid,
     "arenas": arenas known to exist (main arena + arenas created since attach),
     "arenas_created", "arena_reuse", "arena_reuse_free_list", "arena_lock_waits": ints,
     "arena_list": [{"arena": "0x..", "creator_tid": int or None, "attaches": int,
                     "waits": int}],
     "heaps": live non-main-arena heaps, "heap_bytes": their current size in bytes,
     "heap_bytes_max", "heaps_created", "heaps_freed", "heap_grow", "heap_shrink": ints,
     "heap_list": [{"heap": "0x..", "size": int}],
     "sbrk_bytes": bytes the main arena grew by sbrk, "sbrk_grow_count",
     "sbrk_trimmed_bytes", "sbrk_trim_count", "sbrk_failed": ints,
     "mmap_threshold", "trim_threshold": current value (int) or None if unknown,
     "params": {name: {"value": int, "cause": "mallopt"|"tunable"|"dynamic"|"initial",
                       "source": "probe"|"memory"}}  for mxfast, trim_threshold,
               top_pad, mmap_threshold, mmap_max, perturb, arena_test, arena_max,
               tcache_max, tcache_count, tcache_unsorted_limit (those whose probe
               fired, else read from the live process's memory at the probe's operand),
     "dyn_threshold_changes", "mallopt_calls", "tcache_double_free_scans": ints,
     "retries": {"malloc", "realloc", "calloc", "memalign", "arena": ints},
     "lock_waits": {tid: arena lock waits of that thread},
     "threads": {tid: {"lock_waits": int, "arena": "0x.." or None, "arena_switches": int}}}

The heap sampler's call sites per process ("stacks": {pid: ...}; top --stacks -p PID only):

    {"pid": int, "comm": str, "sample_bytes": the sampler's mean (1: every call),
     "samples": samples taken since attach, "complete_samples": those unwound to the root,
     "stacks_kept": distinct stacks kept, "max_stacks": the cap (sources.stacksites.MAX_STACKS),
     "overflow_samples": samples of stacks beyond the cap (counted under "[other stacks]"),
     "sites": {site key ("MODULE_PATH+0xPC", or "[other stacks]"): {
         "function": name of the call site (the first frame outside libc/libstdc++),
         "module": its file's name, "offset": its pc in that file,
         "alloc_objects", "alloc_bytes": weighted estimates of the calls and bytes since
             attach (cumulative: rates come from two snapshots),
         "inuse_objects", "inuse_bytes": weighted sampled blocks not freed at the snapshot,
         "samples": raw samples behind the estimates,
         "stacks": [{"id": int (stable within a run), the same five values and "complete",
                     "frames": [{"function", "module", "file", "line", "inlined"}]
                               root first, leaf (malloc) last}]}}}

Exited processes: a process that exits appears once more with "exited": True, then its
state is deleted; every per-process map is bounded and LRU (pymtrace.sources.base
says how, and what "evicted" counts).

The TypedDicts are written for Python 3.9 (no Required/NotRequired): a class holds the keys
always present, a `total=False` subclass adds those that depend on the sources running.
"""

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, TypedDict

from pymtrace.bpf import structs

# ---------------------------------------------------------------- call names


def call_names() -> Dict[int, str]:
    """{index in ms_stats.calls: snapshot name}, from the CALL_* / MS_FREE_NULL constants of
    bpf/common.h and bpf/malloc_stats.h."""
    consts = structs.header("malloc_stats").consts
    names = {consts[k]: k[len("CALL_") :].lower() for k in consts if k.startswith("CALL_")}
    names[consts["MS_FREE_NULL"]] = "free_null"
    return names


# The order in which views and top's totals show the calls (a display choice, not a list of
# names: the names are the headers'; one the headers add and this omits comes last).
_DISPLAY_ORDER = (
    "malloc",
    "calloc",
    "realloc",
    "free",
    "free_null",
    "memalign",
    "posix_memalign",
    "valloc",
    "pvalloc",
    "new",
    "new_array",
    "new_nothrow",
    "new_aligned",
    "delete",
    "delete_array",
    "delete_sized",
    "delete_aligned",
)


def _display_key(name: str) -> Tuple[int, str]:
    return (_DISPLAY_ORDER.index(name) if name in _DISPLAY_ORDER else len(_DISPLAY_ORDER), name)


CALLS: Tuple[str, ...] = tuple(sorted(set(call_names().values()), key=_display_key))
"""The keys of a process's "calls", in display order."""
# C++ operator new/delete, each variant its own call type (bpf/malloc_stats.h CALL_NEW..)
NEW_CALLS: Tuple[str, ...] = tuple(c for c in CALLS if c.startswith("new"))
DELETE_CALLS: Tuple[str, ...] = tuple(c for c in CALLS if c.startswith("delete"))
FREE_CALLS = ("free", "free_null") + DELETE_CALLS
ALLOC_CALLS: Tuple[str, ...] = tuple(c for c in CALLS if c not in FREE_CALLS)


# ---------------------------------------------------------------- the schema


class _ProcessBase(TypedDict):
    pid: int
    comm: str


class ProcessEntry(_ProcessBase, total=False):
    """snapshot["processes"][pid]: the merge of every source's entry for the process."""

    exited: bool
    calls: Dict[str, int]  # keys: CALLS
    requested_bytes: int
    allocated_bytes: int
    freed_bytes: int
    live_bytes: int
    block_bytes: str
    failed: int
    size_log2: List[int]
    rss_bytes: int
    rss_anon_bytes: int
    rss_anon_base_bytes: int
    heap_flag: Optional[bool]
    faults_user: int
    faults_kernel: int
    allocator: str
    allocator_traced: bool
    estimated: bool
    estimate: "EstimateInfo"


class EstimateInfo(TypedDict):
    """snapshot["processes"][pid]["estimate"]: under an overhead budget."""

    windows: int
    error: Optional[float]
    sampled_calls: int
    sampled_seconds: float
    sampled_cpu_seconds: float  # its CPU time in the windows' measured parts
    last_window_age: Optional[float]
    calls_per_second: Optional[float]
    saturated: bool  # slowed by the traps in its last window: its rates are its pace under them
    trap_share: Optional[float]  # of its CPU time in its last window, modeled


class BudgetCost(TypedDict):
    traps: float
    bpf: float
    attach_detach: float


class BudgetInfo(TypedDict):
    """snapshot["budget"]: the overhead budget's state (pymtrace.sources.budget)."""

    max_overhead_pct: float
    window_seconds: float
    windows: int
    bpf_stats_windows: int
    attached: bool
    duty_cycle: float
    overhead_pct: Optional[float]
    traced_cpu_seconds: float
    cost_seconds: BudgetCost
    trap_ns_per_run: float
    trap_spread_ns: float
    trap_single_step_ns: float
    probes: str
    errors: List[str]


class _SlabBase(TypedDict):
    allocs: int
    bytes_alloc: int
    bytes_req: int


class SlabEntry(_SlabBase, total=False):
    """snapshot["slab"][cache]: "frees" is absent when kmem_cache_free has no cache name,
    "caches" present on kernels where rows are keyed by object size ("size N")."""

    frees: int
    caches: List[str]


class _MapFillBase(TypedDict):
    entries: int
    max_entries: int


class MapFill(_MapFillBase, total=False):
    """snapshot["maps"][name]: "evicted" only for the per-process LRU maps."""

    evicted: int


class ArenaInfo(TypedDict):
    arena: str
    creator_tid: Optional[int]
    attaches: int
    waits: int


class HeapInfo(TypedDict):
    heap: str
    size: int


class GlibcParam(TypedDict):
    value: int
    cause: str
    source: str


class GlibcThread(TypedDict):
    lock_waits: int
    arena: Optional[str]
    arena_switches: int


class _GlibcBase(TypedDict):
    pid: int
    comm: str
    alive: bool
    libc: Optional[str]
    probes: int
    reason: Optional[str]


class GlibcProcess(_GlibcBase, total=False):
    """snapshot["glibc"][pid]: the keys below only when the process's libc has probes."""

    events: int
    arenas: int
    arenas_created: int
    arena_reuse: int
    arena_reuse_free_list: int
    arena_lock_waits: int
    arena_list: List[ArenaInfo]
    heaps: int
    heap_bytes: int
    heap_bytes_max: int
    heaps_created: int
    heaps_freed: int
    heap_grow: int
    heap_shrink: int
    heap_list: List[HeapInfo]
    sbrk_bytes: int
    sbrk_grow_count: int
    sbrk_trimmed_bytes: int
    sbrk_trim_count: int
    sbrk_failed: int
    dyn_threshold_changes: int
    mallopt_calls: int
    tcache_double_free_scans: int
    retries: Dict[str, int]
    lock_waits: Dict[int, int]
    threads: Dict[int, GlibcThread]
    params: Dict[str, GlibcParam]
    mmap_threshold: Optional[int]
    trim_threshold: Optional[int]


class StackFrame(TypedDict):
    function: str
    module: str
    file: str
    line: int
    inlined: bool


class StackEntry(TypedDict):
    id: int
    alloc_objects: float
    alloc_bytes: float
    inuse_objects: float
    inuse_bytes: float
    samples: int
    complete: bool
    frames: List[StackFrame]  # root first


class StackSite(TypedDict):
    function: str
    module: str
    offset: int
    alloc_objects: float
    alloc_bytes: float
    inuse_objects: float
    inuse_bytes: float
    samples: int
    stacks: List[StackEntry]


class StackProcess(TypedDict):
    """snapshot["stacks"][pid]: the heap sampler's call sites of one process."""

    pid: int
    comm: str
    sample_bytes: int
    samples: int
    complete_samples: int
    stacks_kept: int
    max_stacks: int
    overflow_samples: int
    sites: Dict[str, StackSite]


class LibcInfo(TypedDict):
    libc: Optional[str]
    probes: int
    sites: int
    attached: bool
    reason: Optional[str]


class GlibcSourceInfo(TypedDict):
    lost_events: int
    map_full: Dict[str, int]
    libcs: List[LibcInfo]
    warnings: List[str]


class _SnapshotBase(TypedDict):
    time: Optional[float]  # None only in a merge of parts that carry no time
    start: Optional[float]
    processes: Dict[int, ProcessEntry]
    lost: Dict[str, int]


class Snapshot(_SnapshotBase, total=False):
    """A whole snapshot (the module docstring says what each key holds)."""

    slab: Dict[str, SlabEntry]
    slab_source: str
    slab_note: str
    fault_regions: Dict[int, Dict[str, int]]
    glibc: Dict[int, GlibcProcess]
    glibc_collector: GlibcSourceInfo
    stacks: Dict[int, StackProcess]
    maps: Dict[str, MapFill]
    errors: Dict[str, str]
    notes: List[str]
    budget: BudgetInfo


# A source's own snapshot: any subset of Snapshot's keys (GlibcSource's has no "time").
SnapshotPart = Mapping[str, Any]

# ---------------------------------------------------------------- the merge

_BY_PID = ("glibc", "fault_regions", "stacks")  # {pid: value}: one source's value per PID
_BY_NAME = ("slab", "maps", "errors")  # {name: value}: one source's value per name


def merge(parts: Iterable[SnapshotPart]) -> Snapshot:
    """One snapshot from PARTS (the sources of one bundle, or the exporter's sources), in
    their order. One rule per key:

    - "processes": per PID, the entries' keys together (a later part's value of a key both
      have wins); "exited" is True when any part says so (the fault source may report
      the exit while the malloc one has not seen it yet);
    - "lost": counts of the same name are SUMMED: every part reads its own BPF maps, so
      counts from independent sources add up. Within one bundle no two programs report the
      same name (each prefixes its own: malloc_, fault_, slab_, glibc_events), so there a sum
      is what `top` always showed; the same source given twice would count twice;
    - "glibc", "fault_regions", "stacks" (by PID), "slab", "maps", "errors" (by name): the union, a
      later part's entry winning;
    - "time", "start": the earliest of the parts' (None if none has one): each part's counts
      hold every event before its own time, so the merged counts hold every event before
      the earliest (the latest would claim events a part read earlier may lack);
    - anything else (slab_source, slab_note, glibc_collector, notes): the last part's value.

    Keys come out in the order of their first appearance after time, start, processes, lost
    (the order `top --json` prints); PID keys are ints. Parts are not modified.
    """
    snap: Dict[str, Any] = {"time": None, "start": None, "processes": {}, "lost": {}}
    for part in parts:
        for key, value in part.items():
            if key == "time":
                if value is not None and (snap["time"] is None or value < snap["time"]):
                    snap["time"] = value
            elif key == "start":
                if value is not None and (snap["start"] is None or value < snap["start"]):
                    snap["start"] = value
            elif key == "processes":
                _merge_processes(snap["processes"], value or {})
            elif key == "lost":
                lost = snap["lost"]
                for name, n in (value or {}).items():
                    lost[str(name)] = lost.get(str(name), 0) + n
            elif key in _BY_PID:
                snap.setdefault(key, {}).update((int(pid), v) for pid, v in (value or {}).items())
            elif key in _BY_NAME:
                snap.setdefault(key, {}).update(value or {})
            else:
                snap[key] = value
    return snap  # type: ignore[return-value]


def _merge_processes(into: Dict[int, Any], processes: Mapping[Any, Mapping[str, Any]]) -> None:
    for pid, p in processes.items():
        merged = into.setdefault(int(pid), {})
        exited = merged.get("exited", False) or p.get("exited", False)
        merged.update(p)
        merged["exited"] = exited
