"""The exporter's metrics: per-label aggregation and the Prometheus metric families.

The sources' snapshots (pymtrace.sources) are cumulative per PID; Aggregator turns them
into per-`comm` (or cgroup, or capped per-PID) series that stay monotonic while processes
come and go, and drops the series of processes gone for longer than a grace period.
ExporterMetrics, a prometheus-client custom collector, reads the sources at every scrape
and yields the families declared as data in METRICS (name, type, help, labels, where the
samples come from), in that order. pymtrace.sinks.http serves the registry.
"""

import re
import sys
import threading
import time
from typing import (
    TYPE_CHECKING,
    Callable,
    Collection,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pymtrace import __version__
from pymtrace.sources import snapshot as snapshot_model
from pymtrace.tracee import proc

if TYPE_CHECKING:
    from pymtrace.bpf.stats import BpfStats

PROC_COUNTERS = ("requested_bytes", "allocated_bytes", "freed_bytes", "failed", "faults_user", "faults_kernel")
# process gauges, summed over a label's live processes; heap_flag (bool, None when it cannot
# be judged: pymtrace.sources.heapefficiency) sums to the number of flagged processes
PROC_GAUGES = ("live_bytes", "rss_bytes", "rss_anon_bytes", "heap_flag")
# glibc (USDT) values per process: gauges (state now) and counters (cumulative)
GLIBC_GAUGES = {
    "arenas": ("pymtrace_glibc_arenas", "malloc arenas known to exist (main arena + arenas created since attach)"),
    "heaps": ("pymtrace_glibc_heaps", "live non-main-arena heaps (mmap'd heap segments)"),
    "heap_bytes": ("pymtrace_glibc_heap_bytes", "current size of the live non-main-arena heaps"),
    "mmap_threshold": (
        "pymtrace_glibc_mmap_threshold_bytes",
        "current M_MMAP_THRESHOLD (max over the label's processes)",
    ),
    "trim_threshold": (
        "pymtrace_glibc_trim_threshold_bytes",
        "current M_TRIM_THRESHOLD (max over the label's processes)",
    ),
}
GLIBC_COUNTERS = {
    "sbrk_bytes": ("pymtrace_glibc_sbrk_grown_bytes", "bytes the main arena grew by sbrk (memory_sbrk_more)"),
    "sbrk_trimmed_bytes": ("pymtrace_glibc_sbrk_trimmed_bytes", "bytes the main arena gave back (memory_sbrk_less)"),
    "arena_lock_waits": (
        "pymtrace_glibc_arena_lock_waits",
        "times a thread blocked on a locked arena (memory_arena_reuse_wait)",
    ),
    "retries": ("pymtrace_glibc_retries", "allocations retried after a failure (memory_*_retry probes)"),
}
# gauge thresholds are combined over the processes of one label by max, the rest by sum
GLIBC_MAX = {"mmap_threshold", "trim_threshold"}
OTHER = "other"
# a cumulative counter's key: a process entry's field ("freed_bytes") or (group, name or
# bucket): ("calls", "malloc"), ("size", 7), ("glibc", "arenas_created")
CounterKey = Union[str, Tuple[str, Union[str, int]]]


# ---------------------------------------------------------------- aggregation


def flatten_counters(entry: dict) -> dict:
    """A process entry's cumulative counters as {key: number}. An entry of estimates (under
    an overhead budget: "estimated") gives ("calls_estimated", call) and
    "requested_bytes_estimated": series of their own, never mixed with exact counts."""
    out = {}
    estimated = entry.get("estimated", False)
    for call, n in (entry.get("calls") or {}).items():
        out[("calls_estimated" if estimated else "calls", call)] = n
    if estimated:
        if "requested_bytes" in entry:
            out["requested_bytes_estimated"] = entry["requested_bytes"]
        keys = [k for k in PROC_COUNTERS if k != "requested_bytes"]
    else:
        keys = PROC_COUNTERS
        for i, n in enumerate(entry.get("size_log2") or ()):
            if n:
                out[("size", i)] = n
    for key in keys:
        if key in entry:
            out[key] = entry[key]
    return out


def estimate_gauges(entry: dict) -> dict:
    """An estimated entry's error as gauges that sum over a label: its estimated calls, the
    square of their 95 % error in calls (estimate_error_ratio() combines them), and 1 if it
    is saturated (its rates are its pace under the traps)."""
    estimate = entry.get("estimate") or {}
    error = estimate.get("error")
    if not entry.get("estimated") or error is None:
        return {}
    total = sum((entry.get("calls") or {}).values())
    saturated = 1 if estimate.get("saturated") else 0
    return {
        "estimated_calls": total,
        "estimated_calls_error_sq": (error * total) ** 2,
        "estimated_saturated": saturated,
    }


def _glibc_counters(g: Mapping[str, object]) -> Dict[CounterKey, Union[int, float]]:
    out = {}
    for k in GLIBC_COUNTERS:
        v = g.get(k)
        if isinstance(v, dict):  # per thread (lock_waits: {tid: n}) or per probe
            v = sum(x for x in v.values() if isinstance(x, (int, float)))
        if isinstance(v, (int, float)):
            out[("glibc", k)] = v
    return out


class _Pid:
    __slots__ = ("pid", "comm", "want", "label", "base", "last", "gauges", "glibc", "alive", "expired")

    def __init__(self, pid: int, comm: str, want: str) -> None:
        self.pid, self.comm, self.want = pid, comm, want
        self.label = None
        self.base = {}
        self.last = {}
        self.gauges = {}
        self.glibc = {}
        self.alive = True
        self.expired = False


class Aggregator:
    """Cumulative per-PID counters -> monotonic per-label counters.

    Each label's counter is what its exited processes contributed (`retired`) plus what its
    live ones did since they joined it. A process that changes label (exec changes comm,
    or it moves from "other" to a series of its own) hands what it did so far to the old
    label and continues from there under the new one, so no series ever goes down. A label
    none of whose processes has been alive for `grace` seconds is dropped with its totals.
    At most `max_series` labels exist besides "other"; free places go to the busiest newcomers.
    """

    def __init__(
        self,
        label_by: str = "comm",
        max_series: int = 1000,
        grace: float = 300.0,
        pids: Optional[Iterable[int]] = None,
        comm: Optional[str] = None,
        alive: Optional[Callable[[int], bool]] = None,
        cgroup_of: Optional[Callable[[int], Optional[str]]] = None,
    ) -> None:
        self.label_by = label_by
        self.max_series = max_series
        self.grace = grace
        self.pid_filter = set(pids) if pids else None
        self.comm_filter = re.compile(comm) if comm else None
        self.alive = alive or proc.exists
        self.cgroup_of = cgroup_of or proc.cgroup
        self.pids = {}
        self.retired = {}  # label -> {key: n}
        self.admitted = {}  # label -> last time a live process had it
        self.dropped_total = 0

    def wanted(self, pid: int, entry: dict) -> bool:
        if self.pid_filter is not None and pid not in self.pid_filter:
            return False
        if self.comm_filter is not None and not self.comm_filter.search(entry.get("comm") or ""):
            return False
        return True

    def _want_label(self, pid: int, comm: str) -> str:
        if self.label_by == "pid":
            return str(pid)
        if self.label_by == "cgroup":
            return self.cgroup_of(pid) or "unknown"
        return comm if comm and comm != "?" else "unknown"  # "?": exited before its name was read

    def _retire(self, st: _Pid, keys: Optional[Collection[CounterKey]] = None) -> None:
        if st.label is None or st.expired:
            return
        acc = self.retired.setdefault(st.label, {})
        for k, v in st.last.items():
            if keys is not None and k not in keys:
                continue
            d = v - st.base.get(k, 0)
            if d:
                acc[k] = acc.get(k, 0) + d

    def _move(self, st: _Pid, label: str) -> None:
        """Hand what ST did so far to its current label; it continues under LABEL."""
        if st.label is None:  # first label: everything since attach counts for it
            st.label = label
            return
        self._retire(st)
        st.base = dict(st.last)
        st.label = label

    def update(self, processes: dict, glibc: Optional[dict] = None, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        glibc = glibc or {}
        present = set()
        for pid, entry in processes.items():
            pid = int(pid)
            if not self.wanted(pid, entry):
                continue
            present.add(pid)
            comm = entry.get("comm") or ""
            counters = flatten_counters(entry)
            g = glibc.get(pid) or glibc.get(str(pid)) or {}
            counters.update(_glibc_counters(g))
            st = self.pids.get(pid)
            if st is not None:
                down = [k for k, v in st.last.items() if k in counters and counters[k] < v]
                if down and (not st.alive or comm != st.comm):
                    # cumulative values went down: the PID was reused by a new process
                    self._retire(st)
                    st = None
                else:
                    if down:
                        # the same process's entry in one BPF map (LRU) was evicted and
                        # re-created: those counters restart from 0, the label keeps the rest
                        self._retire(st, down)
                        for k in down:
                            st.base[k] = 0
                    # one source may drop an exited process a snapshot before another
                    # does: what it stopped reporting keeps its last value
                    counters = {**st.last, **counters}
            if st is None:
                st = self.pids[pid] = _Pid(pid, comm, self._want_label(pid, comm))
            elif comm != st.comm:  # exec: same process, new name; the old one keeps what it did
                self._retire(st)
                st.base = dict(st.last)
                st.label = None
                st.comm = comm
                st.want = self._want_label(pid, comm)
            st.last = counters
            st.gauges = {k: int(entry[k]) for k in PROC_GAUGES if entry.get(k) is not None}
            st.gauges.update(estimate_gauges(entry))
            st.glibc = {k: g[k] for k in GLIBC_GAUGES if isinstance(g.get(k), (int, float))}
            st.alive = not entry.get("exited") and self.alive(pid)
        # processes no longer in the sources' maps: their work stays with their label
        for pid in [p for p in self.pids if p not in present]:
            self._retire(self.pids.pop(pid))

        # which labels are alive
        for st in self.pids.values():
            if st.alive and st.label is not None and not st.expired:
                self.admitted[st.label] = now
        # labels gone longer than the grace period give up their places now; they are dropped
        # below unless new processes take them in this same update (then the series never
        # left a scrape, so it goes on from its totals: a restart at 0 could not be seen)
        expiring = [label for label, seen in self.admitted.items() if now - seen > self.grace]
        for label in expiring:
            del self.admitted[label]
        for label in [lb for lb in self.retired if lb not in self.admitted and lb not in expiring]:
            del self.retired[label]

        # give each live process its label: its own if admitted or there is room, else "other"
        newcomers = {}
        for st in self.pids.values():
            if st.expired or not st.alive and st.label is not None:
                continue
            if st.want in self.admitted:
                if st.label != st.want:
                    self._move(st, st.want)
            else:
                newcomers.setdefault(st.want, []).append(st)
        room = self.max_series - sum(1 for lb in self.admitted if lb != OTHER)
        ranked = sorted(newcomers.items(), key=lambda kv: -sum(_activity(s) for s in kv[1]))
        for label, members in ranked:
            if room > 0 and label != OTHER:
                room -= 1
                target = label
            else:
                target = OTHER
            self.admitted[target] = now
            for st in members:
                if st.label != target:
                    self._move(st, target)
        for st in self.pids.values():
            if st.alive and st.label is not None and not st.expired:
                self.admitted[st.label] = now
        for label in expiring:
            if label in self.admitted:
                continue
            self.retired.pop(label, None)
            self.dropped_total += 1
            for st in self.pids.values():
                if st.label == label and not st.alive:
                    st.expired = True

    def series(self) -> Dict[str, dict]:
        """{label: {"counters": {...}, "gauges": {...}, "glibc": {...}}} for admitted labels."""
        out = {lb: {"counters": dict(self.retired.get(lb, {})), "gauges": {}, "glibc": {}} for lb in self.admitted}
        for st in self.pids.values():
            if st.expired or st.label not in out:
                continue
            s = out[st.label]
            c = s["counters"]
            for k, v in st.last.items():  # zeros too: a counter exists from its first 0
                c[k] = c.get(k, 0) + v - st.base.get(k, 0)
            if st.alive:
                for k, v in st.gauges.items():
                    s["gauges"][k] = s["gauges"].get(k, 0) + v
                for k, v in st.glibc.items():
                    cur = s["glibc"].get(k)
                    s["glibc"][k] = v if cur is None else (max(cur, v) if k in GLIBC_MAX else cur + v)
        return out


def _activity(st: _Pid) -> Union[int, float]:
    return sum(
        v - st.base.get(k, 0)
        for k, v in st.last.items()
        if isinstance(k, tuple) and k[0] in ("calls", "calls_estimated")
    )


def _prune_glibc(src: object) -> None:
    """The glibc source keeps exited processes until told: drop them once read."""
    inner = getattr(src, "sources", None)
    g = inner.get("glibc") if isinstance(inner, dict) else None
    if g is not None and hasattr(g, "prune"):
        try:
            g.prune()
        except (KeyError, OSError) as exc:  # a BPF map that cannot be read: said, and tried again next scrape
            print(f"pymtrace exporter: forgetting exited processes failed: {exc!r}", file=sys.stderr)


# ---------------------------------------------------------------- merging the sources


def merge_sources(sources: Iterable) -> dict:
    """One merged snapshot of every source (sources are sources.bundle.Sources bundles,
    single sources, or test fakes: all produce pymtrace.sources.snapshot's schema), by
    snapshot.merge (the rule top uses too), plus the exporter's extras: the glibc
    source's map-full losses as lost causes (its ring-buffer losses are already there, as
    "glibc_events"), and processes only the glibc probes saw."""
    parts = []
    for src in sources:
        parts.append(src.snapshot() or {})
        _prune_glibc(src)
    merged = snapshot_model.merge(parts)  # the one merge rule, shared with top
    for key in ("slab", "glibc", "errors"):
        merged.setdefault(key, {})
    gc = merged.get("glibc_collector") or {}
    if gc:
        for name, n in (gc.get("map_full") or {}).items():
            merged["lost"][f"glibc_{name}_full"] = n
    for pid, g in merged["glibc"].items():  # a process seen only by the glibc probes
        if pid not in merged["processes"] and isinstance(g, dict):
            merged["processes"][pid] = {
                "pid": pid,
                "comm": g.get("comm") or proc.comm(pid),
                "exited": g.get("alive") is False,
            }
    return merged


# ---------------------------------------------------------------- metric families, declared as data


def size_bucket_le(i: int) -> float:
    """Upper bound (bytes) of BPF log2 size bucket I as pymtrace.sources.malloc fills them:
    bucket 0 holds size 0, bucket i sizes in [2**(i-1), 2**i - 1]; sizes are integers, so
    `le` = 2**i - 1 is exact (0, 1, 3, 7, ..., 1023, ...)."""
    return float(2**i - 1) if i > 0 else 0.0


def _fmt_le(v: float) -> str:
    return floatToGoString(v)  # "1.0", "1024.0", "1.099511627776e+12": canonical for OpenMetrics


class Scrape(NamedTuple):
    """What one scrape read: the input of the sample functions of METRICS."""

    metrics: "ExporterMetrics"
    snap: dict  # the merged snapshot (merge_sources)
    series: List[Tuple[str, dict]]  # Aggregator.series() as (label, series), sorted by label
    bpf: Optional[dict]  # BpfStats.read(), or None without BPF statistics
    ok: bool  # every source was read
    started: float  # time.perf_counter() when the scrape began


Samples = Iterable[Tuple[Sequence[str], object]]  # (label values, value); a histogram's value: (buckets, sum)

LABEL = "{label}"  # in a Metric's labels and help: the per-process label's name (--label-by)


class Metric(NamedTuple):
    """One metric family: its name, type, help, label names, and where its samples come from."""

    name: str
    type: str  # "counter", "gauge" or "histogram"
    help: str
    labels: Tuple[str, ...]
    samples: Callable[[Scrape], Samples]
    when: Optional[Callable[[Scrape], bool]] = None  # the family exists only when this holds
    omit_empty: bool = False  # no family at all when it has no samples


def _per_label(values: Callable[[dict], Iterable[Tuple[tuple, object]]]) -> Callable[[Scrape], Samples]:
    """Samples of a per-process family: VALUES(one label's series) -> [(further label values, value)]."""

    def samples(scrape: Scrape) -> Samples:
        for label, s in scrape.series:
            for more, v in values(s):
                yield [label, *more], v

    return samples


def _counter(key: CounterKey) -> Callable[[Scrape], Samples]:
    """Per label: its cumulative counter KEY (no sample where it has none)."""
    return _per_label(lambda s: [((), s["counters"][key])] if key in s["counters"] else ())


def _gauge(group: str, key: str) -> Callable[[Scrape], Samples]:
    """Per label: gauge KEY of its GROUP ("gauges": process gauges, "glibc": glibc state)."""
    return _per_label(lambda s: [((), s[group][key])] if key in s[group] else ())


def _calls(group: str = "calls") -> Callable[[dict], List[Tuple[Tuple[str], Union[int, float]]]]:
    def values(s: dict) -> List[Tuple[Tuple[str], Union[int, float]]]:
        keyed = sorted((k, v) for k, v in s["counters"].items() if isinstance(k, tuple) and k[0] == group)
        return [((key[1],), v) for key, v in keyed]

    return values


def _estimate_error(s: dict) -> List[Tuple[tuple, float]]:
    """A label's 95 % relative error of its estimated calls: its processes' errors (in calls)
    combined as independent, over their estimated calls."""
    g = s["gauges"]
    if not g.get("estimated_calls"):
        return []
    return [((), g.get("estimated_calls_error_sq", 0) ** 0.5 / g["estimated_calls"])]


def _budget(key: str, scale: float = 1.0) -> Callable[[Scrape], Samples]:
    """The one sample of snapshot["budget"][KEY] (x SCALE), none when it is unknown."""

    def samples(scrape: Scrape) -> Samples:
        v = (scrape.snap.get("budget") or {}).get(key)
        return [((), v * scale)] if isinstance(v, (int, float)) else []

    return samples


def _has_budget(scrape: Scrape) -> bool:
    return bool(scrape.snap.get("budget"))


def _faults(s: dict) -> List[Tuple[Tuple[str], Union[int, float]]]:
    return [
        ((mode,), s["counters"][f"faults_{mode}"]) for mode in ("user", "kernel") if f"faults_{mode}" in s["counters"]
    ]


def _size_histogram(scrape: Scrape) -> Samples:
    """Per label: the BPF log2 size buckets, cumulative, up to the largest bucket seen."""
    for label, s in scrape.series:
        c = s["counters"]
        sizes = {k[1]: v for k, v in c.items() if isinstance(k, tuple) and k[0] == "size"}
        if sizes:
            buckets, acc = [], 0
            for i in range(max(sizes) + 1):  # every bucket up to the largest seen
                acc += sizes.get(i, 0)
                buckets.append((_fmt_le(scrape.metrics.bucket_le(i)), acc))
            buckets.append(("+Inf", acc))
            yield [label], (buckets, c.get("requested_bytes", 0))


def _allocators(scrape: Scrape) -> Samples:
    """(label, allocator): 1 for processes whose malloc calls are counted (glibc, jemalloc,
    tcmalloc, mimalloc, an executable's own malloc), 0 for an allocator that is not (a
    static binary: its calls are not seen)."""
    pids = scrape.metrics.agg.pids
    seen = {}
    for pid, p in (scrape.snap.get("processes") or {}).items():
        st = pids.get(int(pid))
        if "allocator" in p and st is not None and st.label is not None and not p.get("exited"):
            seen[(st.label, p["allocator"])] = 1 if p.get("allocator_traced") else 0
    for key, v in sorted(seen.items()):
        yield list(key), v


def _slab(field: str, default: Optional[int] = None) -> Callable[[Scrape], Samples]:
    """Per slab cache: its FIELD, or DEFAULT where it has none (None: no sample)."""

    def samples(scrape: Scrape) -> Samples:
        for cache, v in sorted((scrape.snap.get("slab") or {}).items()):
            if field in v:
                yield [cache], v[field]
            elif default is not None:
                yield [cache], default

    return samples


def _lost(scrape: Scrape) -> Samples:
    for kind, n in sorted((scrape.snap.get("lost") or {}).items()):
        yield [kind], n


def _collectors_up(scrape: Scrape) -> Samples:
    errors = scrape.snap.get("errors") or {}
    for name in sorted(set(scrape.metrics.source_names) | set(errors)):
        yield [name], 0 if name in errors else 1


def _bpf_progs(field: int) -> Callable[[Scrape], Samples]:
    """Per BPF program: its run count (FIELD 0) or run time in seconds (FIELD 1)."""

    def samples(scrape: Scrape) -> Samples:
        for name, (cnt, ns) in sorted(scrape.bpf["progs"].items()):
            yield [name], (cnt, ns / 1e9)[field]

    return samples


def _bpf_maps(field: int) -> Callable[[Scrape], Samples]:
    """Per BPF map: its entries (FIELD 0) or capacity (FIELD 1)."""

    def samples(scrape: Scrape) -> Samples:
        for name, (n, cap, _t) in sorted(scrape.bpf["maps"].items()):
            yield [name], (n, cap)[field]

    return samples


def _value(of: Callable[[Scrape], object]) -> Callable[[Scrape], Samples]:
    """The one sample of an unlabelled family."""
    return lambda scrape: [((), of(scrape))]


def _scrape_duration(scrape: Scrape) -> float:
    """The scrape's duration so far (read last: it covers building every other family)."""
    c = scrape.metrics
    c.last_duration = time.perf_counter() - scrape.started
    c.scrapes += 1
    return c.last_duration


def _has_bpf(scrape: Scrape) -> bool:
    return scrape.bpf is not None


METRICS: Tuple[Metric, ...] = (
    Metric("pymtrace_malloc_calls", "counter", "malloc-API calls by call type", (LABEL, "call"), _per_label(_calls())),
    Metric(
        "pymtrace_malloc_calls_estimated",
        "counter",
        "malloc-API calls by call type, ESTIMATED under the overhead budget: each process's pace in its "
        "last sampling window, carried on between windows",
        (LABEL, "call"),
        _per_label(_calls("calls_estimated")),
        omit_empty=True,
    ),
    Metric(
        "pymtrace_malloc_requested_bytes_estimated",
        "counter",
        "bytes requested from the malloc API, ESTIMATED under the overhead budget (as the calls)",
        (LABEL,),
        _counter("requested_bytes_estimated"),
        omit_empty=True,
    ),
    Metric(
        "pymtrace_malloc_estimate_error_ratio",
        "gauge",
        "95 % error of the estimated calls of the label's live processes, relative (0.05: +-5 %)",
        (LABEL,),
        _per_label(_estimate_error),
        omit_empty=True,
    ),
    Metric(
        "pymtrace_malloc_estimate_saturated_processes",
        "gauge",
        "the label's processes slowed by the traps in their last window (as by tracing every call): their "
        "estimated rates are their pace under the traps, a lower bound of their untraced pace",
        (LABEL,),
        _gauge("gauges", "estimated_saturated"),
        omit_empty=True,
    ),
    Metric(
        "pymtrace_malloc_requested_bytes",
        "counter",
        "bytes requested from malloc, calloc (nmemb*size), realloc (new size) and the memalign family",
        (LABEL,),
        _counter("requested_bytes"),
    ),
    Metric(
        "pymtrace_malloc_allocated_bytes",
        "counter",
        "chunk bytes of the blocks returned (malloc_usable_size + chunk header); requested bytes on other allocators than glibc",
        (LABEL,),
        _counter("allocated_bytes"),
    ),
    Metric(
        "pymtrace_malloc_freed_bytes",
        "counter",
        "chunk bytes of the blocks freed (free, realloc's old block); on other allocators the requested bytes of blocks allocated since attach",
        (LABEL,),
        _counter("freed_bytes"),
    ),
    Metric("pymtrace_malloc_failures", "counter", "allocation calls that returned NULL", (LABEL,), _counter("failed")),
    Metric(
        "pymtrace_malloc_live_bytes",
        "gauge",
        "allocated minus freed bytes since the exporter attached, over live processes: chunk bytes on glibc (negative when blocks from before attach are freed), requested bytes of the blocks allocated since attach on other allocators",
        (LABEL,),
        _gauge("gauges", "live_bytes"),
    ),
    Metric(
        "pymtrace_process_rss_bytes",
        "gauge",
        "resident bytes (/proc/PID/statm) of the live processes whose malloc calls are counted",
        (LABEL,),
        _gauge("gauges", "rss_bytes"),
    ),
    Metric(
        "pymtrace_process_rss_anon_bytes",
        "gauge",
        "anonymous resident bytes (RssAnon: statm's resident - shared) of the live processes whose malloc calls are counted",
        (LABEL,),
        _gauge("gauges", "rss_anon_bytes"),
    ),
    Metric(
        "pymtrace_process_heap_flagged",
        "gauge",
        "processes whose anonymous RSS grew since attach by more than 1.5x their live malloc bytes and by 64 MiB more (fragmentation or free memory kept by the allocator)",
        (LABEL,),
        _gauge("gauges", "heap_flag"),
    ),
    Metric(
        "pymtrace_malloc_size_bytes",
        "histogram",
        "requested sizes of allocation calls (log2 buckets aggregated in BPF: le = 2^i - 1)",
        (LABEL,),
        _size_histogram,
        omit_empty=True,
    ),
    Metric(
        "pymtrace_page_faults",
        "counter",
        "page faults by mode (user: in user code; kernel: in the kernel touching user memory)",
        (LABEL, "mode"),
        _per_label(_faults),
    ),
    Metric(
        "pymtrace_process_allocator_traced",
        "gauge",
        "1 when the processes' malloc calls are counted (glibc, jemalloc, tcmalloc, mimalloc, another object's own malloc), 0 when their allocator cannot be probed (a static binary) and its calls are not seen",
        (LABEL, "allocator"),
        _allocators,
    ),
    *(Metric(name, "gauge", text, (LABEL,), _gauge("glibc", key)) for key, (name, text) in GLIBC_GAUGES.items()),
    *(
        Metric(name, "counter", text, (LABEL,), _counter(("glibc", key)))
        for key, (name, text) in GLIBC_COUNTERS.items()
    ),
    Metric(
        "pymtrace_slab_allocations",
        "counter",
        "kmem_cache_alloc calls per slab cache",
        ("cache",),
        _slab("allocs", 0),
    ),
    # frees: absent when this kernel cannot attribute frees to caches
    Metric("pymtrace_slab_frees", "counter", "kmem_cache_free calls per slab cache", ("cache",), _slab("frees")),
    Metric(
        "pymtrace_slab_allocated_bytes",
        "counter",
        "bytes allocated per slab cache (object size)",
        ("cache",),
        _slab("bytes_alloc", 0),
    ),
    Metric(
        "pymtrace_slab_requested_bytes",
        "counter",
        "bytes requested per slab cache",
        ("cache",),
        _slab("bytes_req"),
    ),
    Metric(
        "pymtrace_exporter_events_lost",
        "counter",
        "events the BPF programs could not record (full maps or buffers), by cause",
        ("cause",),
        _lost,
    ),
    Metric(
        "pymtrace_exporter_collector_up",
        "gauge",
        "1 when the collector is attached and readable, 0 when it failed (see the exporter's log)",
        ("collector",),
        _collectors_up,
    ),
    Metric(
        "pymtrace_exporter_bpf_program_runs",
        "counter",
        "times each BPF program ran (kernel BPF stats)",
        ("program",),
        _bpf_progs(0),
        when=_has_bpf,
    ),
    Metric(
        "pymtrace_exporter_bpf_program_run_seconds",
        "counter",
        "time spent in each BPF program (kernel BPF stats)",
        ("program",),
        _bpf_progs(1),
        when=_has_bpf,
    ),
    Metric(
        "pymtrace_exporter_bpf_map_entries",
        "gauge",
        "entries in each BPF hash map",
        ("map",),
        _bpf_maps(0),
        when=_has_bpf,
    ),
    Metric(
        "pymtrace_exporter_bpf_map_max_entries",
        "gauge",
        "capacity of each BPF hash map",
        ("map",),
        _bpf_maps(1),
        when=_has_bpf,
    ),
    Metric(
        "pymtrace_exporter_bpf_stats_enabled",
        "gauge",
        "1 when the kernel's BPF run-time statistics are on",
        (),
        _value(lambda sc: 1 if sc.metrics.bpfstats.enabled() else 0),
        when=_has_bpf,
    ),
    Metric(
        "pymtrace_exporter_duty_cycle",
        "gauge",
        "fraction of the time since start the malloc uprobes were attached (overhead budget)",
        (),
        _budget("duty_cycle"),
        when=_has_budget,
    ),
    Metric(
        "pymtrace_exporter_overhead_ratio",
        "gauge",
        "measured cost of the malloc uprobes (traps, BPF run time, attach/detach CPU) over the traced "
        "processes' own CPU time since start",
        (),
        _budget("overhead_pct", 0.01),
        when=_has_budget,
    ),
    Metric(
        "pymtrace_exporter_overhead_budget_ratio",
        "gauge",
        "the overhead budget (--max-overhead / 100)",
        (),
        _budget("max_overhead_pct", 0.01),
        when=_has_budget,
    ),
    Metric(
        "pymtrace_exporter_sampling_windows",
        "counter",
        "windows the malloc uprobes were attached for (overhead budget)",
        (),
        _budget("windows"),
        when=_has_budget,
    ),
    Metric(
        "pymtrace_exporter_processes",
        "gauge",
        "processes the exporter currently tracks",
        (),
        _value(lambda sc: len(sc.metrics.agg.pids)),
    ),
    Metric(
        "pymtrace_exporter_series_labels",
        "gauge",
        f"values of the {LABEL} label currently exported (cap: --max-series, plus other)",
        (),
        _value(lambda sc: len(sc.series)),
    ),
    Metric(
        "pymtrace_exporter_series_dropped",
        "counter",
        "label values dropped after their processes were gone for the grace period",
        (),
        _value(lambda sc: sc.metrics.agg.dropped_total),
    ),
    Metric(
        "pymtrace_exporter_collect_success",
        "gauge",
        "1 when this scrape read every source",
        (),
        _value(lambda sc: 1 if sc.ok else 0),
    ),
    Metric(
        "pymtrace_exporter_build_info",
        "gauge",
        "pymtrace version and mode",
        ("version", "mode", "label_by"),
        lambda sc: [([__version__, sc.metrics.mode, sc.metrics.label], 1)],
    ),
    Metric(
        "pymtrace_exporter_scrape_duration_seconds",
        "gauge",
        "time this scrape took to read the maps and build the metrics",
        (),
        _value(_scrape_duration),
    ),
)

_FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def families(metrics: Iterable[Metric], scrape: Scrape, label_name: str) -> Iterator:
    """The prometheus-client families of METRICS for one SCRAPE, in table order; LABEL in a
    metric's labels and help becomes LABEL_NAME."""
    for m in metrics:
        if m.when is not None and not m.when(scrape):
            continue
        labels = [label_name if n == LABEL else n for n in m.labels]
        fam = _FAMILY[m.type](m.name, m.help.replace(LABEL, label_name), labels=labels)
        empty = True
        for values, value in m.samples(scrape):
            if m.type == "histogram":
                fam.add_metric(list(values), *value)
            else:
                fam.add_metric(list(values), value)
            empty = False
        if not (m.omit_empty and empty):
            yield fam


class ExporterMetrics:
    """prometheus-client custom collector: reads the sources' maps at every scrape."""

    def __init__(
        self,
        sources: Iterable,
        aggregator: Aggregator,
        bpfstats: Optional["BpfStats"] = None,
        label_by: str = "comm",
        mode: str = "always-on",
        bucket_le: Callable[[int], float] = size_bucket_le,
        now: Optional[Callable[[], float]] = None,
    ) -> None:
        self.sources = list(sources)
        self.agg = aggregator
        self.bpfstats = bpfstats
        self.label = label_by
        self.mode = mode
        self.bucket_le = bucket_le
        self._now = now
        self.lock = threading.Lock()
        self.source_names = []
        for src in self.sources:
            inner = getattr(src, "sources", None)
            self.source_names += (
                list(inner) if isinstance(inner, dict) else [getattr(src, "name", None) or type(src).__name__]
            )
        self.last_duration = 0.0
        self.scrapes = 0
        self.errors = 0

    def describe(self) -> list:
        return []  # families depend on the data; avoid a collect() at registration

    def snapshot(self) -> dict:
        """One merged snapshot of every source (merge_sources)."""
        return merge_sources(self.sources)

    def collect(self) -> Iterator:
        t0 = time.perf_counter()
        with self.lock:
            try:
                snap = self.snapshot()
                self.agg.update(snap["processes"], snap["glibc"], now=self._now() if self._now else None)
                series = self.agg.series()
                ok = True
            except Exception as exc:  # a failed map read must not kill the endpoint: said, counted, collect_success 0
                print(f"pymtrace exporter: collecting failed: {exc}", file=sys.stderr)
                snap, series, ok = {"slab": {}, "lost": {}, "errors": {}}, {}, False
                self.errors += 1
            bpf = self.bpfstats.read() if self.bpfstats else None
        yield from families(METRICS, Scrape(self, snap, sorted(series.items()), bpf, ok, t0), self.label)
