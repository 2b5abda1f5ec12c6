"""`pymtrace exporter`: serve the live malloc/slab/fault/glibc metrics to Prometheus.

The exporter runs the same collectors as `pymtrace top` (pymtrace.collect.base.Collectors)
and reads their BPF maps at scrape time through a prometheus-client custom collector.
Their snapshots are cumulative per PID; this module turns them into per-`comm` (or
cgroup, or capped per-PID) series that stay monotonic while processes come and go, and
drops the series of processes gone for longer than a grace period.
"""

import collections
import gzip
import html
import io
import os
import re
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import choose_encoder

from pymtrace import __version__
from pymtrace.errors import PymtraceError

DEFAULT_PORT = 19733
HELP = """Serve live allocation metrics to Prometheus (/metrics), from the same BPF
collectors as `pymtrace top`. Per-process series are labelled by comm (default),
cgroup, or PID; at most --max-series label values (default 500, 20 by PID) plus "other"."""
EPILOG = f"""examples:
  sudo pymtrace exporter                              # all processes, :{DEFAULT_PORT}: tracepoints + USDT + faults
  sudo pymtrace exporter --per-call -p 1234           # plus per-call malloc counts (costly, see OVERHEAD)
  sudo pymtrace exporter --comm '^(nginx|postgres)$' --listen 127.0.0.1:{DEFAULT_PORT}
  sudo pymtrace exporter --per-call --label-by pid --max-series 20 -p 1234 -p 5678
  sudo pymtrace exporter --web-config /etc/pymtrace/web.yml   # TLS and basic auth

The default port {DEFAULT_PORT} lies outside the 9100-9999 range of Prometheus's default
port allocation list (that range is fully allocated). See docs/exporter.md for the metrics
and the deploy files in exporters/.

OVERHEAD: by default nothing runs on the malloc path (page-fault and slab tracepoints,
glibc's USDT probes on its slow paths: no measurable slowdown of malloc; ~0.1-0.3 us per
page fault). --per-call adds `pymtrace top`'s uprobes on malloc, calloc, realloc, free and
the memalign family of every traced libc -- of EVERY glibc process on the host unless -p
narrows it: a malloc+free pair then costs ~2 us instead of ~15 ns (~145x, measured on a
busy 2-core machine, bench/exporter_bench.py; an allocation-heavy Python program ran
8-13x slower). A scrape reads the BPF maps: ~50 ms and ~5 % of a core at one scrape a
second for ~1,000 series, ~0.5 s for ~14,000. Start-up compiles the BPF programs
(seconds; longer on a loaded machine). See docs/exporter.md."""

PROC_COUNTERS = ("requested_bytes", "allocated_bytes", "freed_bytes", "failed", "faults_user", "faults_kernel")
PROC_GAUGES = ("live_bytes",)
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


# ---------------------------------------------------------------- aggregation


def flatten_counters(entry):
    """A process entry's cumulative counters as {key: number}."""
    out = {}
    for call, n in (entry.get("calls") or {}).items():
        out[("calls", call)] = n
    for key in PROC_COUNTERS:
        if key in entry:
            out[key] = entry[key]
    for i, n in enumerate(entry.get("size_log2") or ()):
        if n:
            out[("size", i)] = n
    return out


def _glibc_counters(g):
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

    def __init__(self, pid, comm, want):
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

    def __init__(self, label_by="comm", max_series=1000, grace=300.0, pids=None, comm=None, alive=None, cgroup_of=None):
        self.label_by = label_by
        self.max_series = max_series
        self.grace = grace
        self.pid_filter = set(pids) if pids else None
        self.comm_filter = re.compile(comm) if comm else None
        self.alive = alive or _proc_alive
        self.cgroup_of = cgroup_of or _cgroup_of
        self.pids = {}
        self.retired = {}  # label -> {key: n}
        self.admitted = {}  # label -> last time a live process had it
        self.dropped_total = 0

    def wanted(self, pid, entry):
        if self.pid_filter is not None and pid not in self.pid_filter:
            return False
        if self.comm_filter is not None and not self.comm_filter.search(entry.get("comm") or ""):
            return False
        return True

    def _want_label(self, pid, comm):
        if self.label_by == "pid":
            return str(pid)
        if self.label_by == "cgroup":
            return self.cgroup_of(pid) or "unknown"
        return comm if comm and comm != "?" else "unknown"  # "?": exited before its name was read

    def _retire(self, st, keys=None):
        if st.label is None or st.expired:
            return
        acc = self.retired.setdefault(st.label, {})
        for k, v in st.last.items():
            if keys is not None and k not in keys:
                continue
            d = v - st.base.get(k, 0)
            if d:
                acc[k] = acc.get(k, 0) + d

    def _move(self, st, label):
        """Hand what ST did so far to its current label; it continues under LABEL."""
        if st.label is None:  # first label: everything since attach counts for it
            st.label = label
            return
        self._retire(st)
        st.base = dict(st.last)
        st.label = label

    def update(self, processes, glibc=None, now=None):
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
                    # one collector may drop an exited process a snapshot before another
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
            st.gauges = {k: entry[k] for k in PROC_GAUGES if k in entry}
            st.glibc = {k: g[k] for k in GLIBC_GAUGES if isinstance(g.get(k), (int, float))}
            st.alive = not entry.get("exited") and self.alive(pid)
        # processes no longer in the collectors' maps: their work stays with their label
        for pid in [p for p in self.pids if p not in present]:
            self._retire(self.pids.pop(pid))

        # which labels are alive
        for st in self.pids.values():
            if st.alive and st.label is not None and not st.expired:
                self.admitted[st.label] = now
        # drop labels gone longer than the grace period
        for label, seen in list(self.admitted.items()):
            if now - seen > self.grace:
                del self.admitted[label]
                self.retired.pop(label, None)
                self.dropped_total += 1
                for st in self.pids.values():
                    if st.label == label and not st.alive:
                        st.expired = True
        for label in [lb for lb in self.retired if lb not in self.admitted]:
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

    def series(self):
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


def _activity(st):
    return sum(v - st.base.get(k, 0) for k, v in st.last.items() if isinstance(k, tuple) and k[0] == "calls")


def _prune_glibc(src):
    """The glibc collector keeps exited processes until told: drop them once read."""
    inner = getattr(src, "collectors", None)
    g = inner.get("glibc") if isinstance(inner, dict) else None
    if g is not None and hasattr(g, "prune"):
        try:
            g.prune()
        except Exception:
            pass


def _comm_of(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_alive(pid):
    return os.path.exists(f"/proc/{pid}")


_cgroup_cache = {}


def _cgroup_of(pid):
    """The process's cgroup v2 path (or the v1 memory controller's), cached per PID."""
    hit = _cgroup_cache.get(pid)
    if hit is not None:
        return hit
    path = None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and (parts[0] == "0" and parts[1] == "" or "memory" in parts[1].split(",")):
                    path = parts[2] or "/"
                    if parts[0] == "0":
                        break
    except OSError:
        return None
    if len(_cgroup_cache) > 65536:
        _cgroup_cache.clear()
    _cgroup_cache[pid] = path
    return path


# ---------------------------------------------------------------- metric families


def size_bucket_le(i):
    """Upper bound (bytes) of BPF log2 size bucket I as pymtrace.collect.malloc fills them:
    bucket 0 holds size 0, bucket i sizes in [2**(i-1), 2**i - 1]; sizes are integers, so
    `le` = 2**i - 1 is exact (0, 1, 3, 7, ..., 1023, ...)."""
    return float(2**i - 1) if i > 0 else 0.0


class ExporterCollector:
    """prometheus-client custom collector: reads the collectors' maps at every scrape."""

    def __init__(
        self, sources, aggregator, bpfstats=None, label_by="comm", mode="always-on", bucket_le=size_bucket_le, now=None
    ):
        self.sources = list(sources)
        self.agg = aggregator
        self.bpfstats = bpfstats
        self.label = label_by
        self.mode = mode
        self.bucket_le = bucket_le
        self._now = now
        self.lock = threading.Lock()
        self.collector_names = []
        for src in self.sources:
            inner = getattr(src, "collectors", None)
            self.collector_names += (
                list(inner) if isinstance(inner, dict) else [getattr(src, "name", None) or type(src).__name__]
            )
        self.last_duration = 0.0
        self.scrapes = 0
        self.errors = 0

    def describe(self):
        return []  # families depend on the data; avoid a collect() at registration

    def snapshot(self):
        """One merged snapshot of every source (sources are collect.Collectors bundles,
        single collectors, or test fakes: all produce the collect.py schema)."""
        merged = {"processes": {}, "slab": {}, "lost": {}, "glibc": {}, "errors": {}}
        for src in self.sources:
            snap = src.snapshot() or {}
            for pid, e in (snap.get("processes") or {}).items():
                cur = merged["processes"].get(int(pid))
                merged["processes"][int(pid)] = e if cur is None else {**cur, **e}
            merged["slab"].update(snap.get("slab") or {})
            for pid, g in (snap.get("glibc") or {}).items():
                merged["glibc"][int(pid)] = g
            for kind, n in (snap.get("lost") or {}).items():
                merged["lost"][str(kind)] = merged["lost"].get(str(kind), 0) + n
            gc = snap.get("glibc_collector") or {}
            if gc:
                merged["lost"]["glibc_ringbuf"] = gc.get("lost_events", 0)
                for name, n in (gc.get("map_full") or {}).items():
                    merged["lost"][f"glibc_{name}_full"] = n
            merged["errors"].update(snap.get("errors") or {})
            _prune_glibc(src)
        for pid, g in merged["glibc"].items():  # a process seen only by the glibc probes
            if pid not in merged["processes"] and isinstance(g, dict):
                merged["processes"][pid] = {
                    "pid": pid,
                    "comm": g.get("comm") or _comm_of(pid),
                    "exited": g.get("alive") is False,
                }
        return merged

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        t0 = time.perf_counter()
        with self.lock:
            try:
                snap = self.snapshot()
                self.agg.update(snap["processes"], snap["glibc"], now=self._now() if self._now else None)
                series = self.agg.series()
                ok = True
            except Exception as exc:  # a failed map read must not kill the endpoint
                print(f"pymtrace exporter: collecting failed: {exc}", file=sys.stderr)
                snap, series, ok = {"slab": {}, "lost": {}, "errors": {}}, {}, False
                self.errors += 1
            bpf = self.bpfstats.read() if self.bpfstats else None
        lab = self.label
        calls = CounterMetricFamily("pymtrace_malloc_calls", "malloc-API calls by call type", labels=[lab, "call"])
        req = CounterMetricFamily(
            "pymtrace_malloc_requested_bytes",
            "bytes requested from malloc, calloc (nmemb*size), realloc (new size) and the memalign family",
            labels=[lab],
        )
        alloc = CounterMetricFamily(
            "pymtrace_malloc_allocated_bytes",
            "chunk bytes of the blocks returned (malloc_usable_size + chunk header)",
            labels=[lab],
        )
        freed = CounterMetricFamily(
            "pymtrace_malloc_freed_bytes", "chunk bytes of the blocks freed (free, realloc's old block)", labels=[lab]
        )
        failed = CounterMetricFamily("pymtrace_malloc_failures", "allocation calls that returned NULL", labels=[lab])
        live = GaugeMetricFamily(
            "pymtrace_malloc_live_bytes",
            "allocated minus freed chunk bytes since the exporter attached, over live processes (negative when blocks from before attach are freed)",
            labels=[lab],
        )
        hist = HistogramMetricFamily(
            "pymtrace_malloc_size_bytes",
            "requested sizes of allocation calls (log2 buckets aggregated in BPF: le = 2^i - 1)",
            labels=[lab],
        )
        faults = CounterMetricFamily(
            "pymtrace_page_faults",
            "page faults by mode (user: in user code; kernel: in the kernel touching user memory)",
            labels=[lab, "mode"],
        )
        g_gauges = {k: GaugeMetricFamily(n, h, labels=[lab]) for k, (n, h) in GLIBC_GAUGES.items()}
        g_counters = {k: CounterMetricFamily(n, h, labels=[lab]) for k, (n, h) in GLIBC_COUNTERS.items()}
        have_hist = False
        for label, s in sorted(series.items()):
            c = s["counters"]
            for key, v in sorted((k, v) for k, v in c.items() if isinstance(k, tuple) and k[0] == "calls"):
                calls.add_metric([label, key[1]], v)
            for fam, key in (
                (req, "requested_bytes"),
                (alloc, "allocated_bytes"),
                (freed, "freed_bytes"),
                (failed, "failed"),
            ):
                if key in c:
                    fam.add_metric([label], c[key])
            if "live_bytes" in s["gauges"]:
                live.add_metric([label], s["gauges"]["live_bytes"])
            sizes = {k[1]: v for k, v in c.items() if isinstance(k, tuple) and k[0] == "size"}
            if sizes:
                have_hist = True
                buckets, acc = [], 0
                for i in range(max(sizes) + 1):  # every bucket up to the largest seen
                    acc += sizes.get(i, 0)
                    buckets.append((_fmt_le(self.bucket_le(i)), acc))
                buckets.append(("+Inf", acc))
                hist.add_metric([label], buckets, c.get("requested_bytes", 0))
            for mode in ("user", "kernel"):
                if f"faults_{mode}" in c:
                    faults.add_metric([label, mode], c[f"faults_{mode}"])
            for k, v in s["glibc"].items():
                g_gauges[k].add_metric([label], v)
            for k in GLIBC_COUNTERS:
                if ("glibc", k) in c:
                    g_counters[k].add_metric([label], c[("glibc", k)])
        yield from (calls, req, alloc, freed, failed, live)
        if have_hist:
            yield hist
        yield faults
        yield self._allocators(snap, lab)
        yield from g_gauges.values()
        yield from g_counters.values()

        slab = snap.get("slab") or {}
        s_allocs = CounterMetricFamily(
            "pymtrace_slab_allocations", "kmem_cache_alloc calls per slab cache", labels=["cache"]
        )
        s_frees = CounterMetricFamily("pymtrace_slab_frees", "kmem_cache_free calls per slab cache", labels=["cache"])
        s_bytes = CounterMetricFamily(
            "pymtrace_slab_allocated_bytes", "bytes allocated per slab cache (object size)", labels=["cache"]
        )
        s_req = CounterMetricFamily("pymtrace_slab_requested_bytes", "bytes requested per slab cache", labels=["cache"])
        for cache, v in sorted(slab.items()):
            s_allocs.add_metric([cache], v.get("allocs", 0))
            if "frees" in v:  # absent when this kernel cannot attribute frees to caches
                s_frees.add_metric([cache], v["frees"])
            s_bytes.add_metric([cache], v.get("bytes_alloc", 0))
            if "bytes_req" in v:
                s_req.add_metric([cache], v["bytes_req"])
        yield from (s_allocs, s_frees, s_bytes, s_req)

        lost = CounterMetricFamily(
            "pymtrace_exporter_events_lost",
            "events the BPF programs could not record (full maps or buffers), by cause",
            labels=["cause"],
        )
        for kind, n in sorted((snap.get("lost") or {}).items()):
            lost.add_metric([kind], n)
        yield lost
        errors = snap.get("errors") or {}
        up = GaugeMetricFamily(
            "pymtrace_exporter_collector_up",
            "1 when the collector is attached and readable, 0 when it failed (see the exporter's log)",
            labels=["collector"],
        )
        for name in sorted(set(self.collector_names) | set(errors)):
            up.add_metric([name], 0 if name in errors else 1)
        yield up
        if bpf is not None:
            runs = CounterMetricFamily(
                "pymtrace_exporter_bpf_program_runs",
                "times each BPF program ran (kernel BPF stats)",
                labels=["program"],
            )
            rtime = CounterMetricFamily(
                "pymtrace_exporter_bpf_program_run_seconds",
                "time spent in each BPF program (kernel BPF stats)",
                labels=["program"],
            )
            for name, (cnt, ns) in sorted(bpf["progs"].items()):
                runs.add_metric([name], cnt)
                rtime.add_metric([name], ns / 1e9)
            entries = GaugeMetricFamily(
                "pymtrace_exporter_bpf_map_entries", "entries in each BPF hash map", labels=["map"]
            )
            maxe = GaugeMetricFamily(
                "pymtrace_exporter_bpf_map_max_entries", "capacity of each BPF hash map", labels=["map"]
            )
            for name, (n, cap, _t) in sorted(bpf["maps"].items()):
                entries.add_metric([name], n)
                maxe.add_metric([name], cap)
            yield from (runs, rtime, entries, maxe)
            yield GaugeMetricFamily(
                "pymtrace_exporter_bpf_stats_enabled",
                "1 when the kernel's BPF run-time statistics are on",
                value=1 if self.bpfstats.enabled() else 0,
            )
        yield GaugeMetricFamily(
            "pymtrace_exporter_processes", "processes the exporter currently tracks", value=len(self.agg.pids)
        )
        yield GaugeMetricFamily(
            "pymtrace_exporter_series_labels",
            f"values of the {lab} label currently exported (cap: --max-series, plus other)",
            value=len(series),
        )
        yield CounterMetricFamily(
            "pymtrace_exporter_series_dropped",
            "label values dropped after their processes were gone for the grace period",
            value=self.agg.dropped_total,
        )
        yield GaugeMetricFamily(
            "pymtrace_exporter_collect_success", "1 when this scrape read every collector", value=1 if ok else 0
        )
        info = GaugeMetricFamily(
            "pymtrace_exporter_build_info", "pymtrace version and mode", labels=["version", "mode", "label_by"]
        )
        info.add_metric([__version__, self.mode, lab], 1)
        yield info
        self.last_duration = time.perf_counter() - t0
        self.scrapes += 1
        yield GaugeMetricFamily(
            "pymtrace_exporter_scrape_duration_seconds",
            "time this scrape took to read the maps and build the metrics",
            value=self.last_duration,
        )

    def _allocators(self, snap, lab):
        """pymtrace_process_allocator_traced{LABEL, allocator}: 1 for processes whose malloc is
        the traced glibc, 0 for another allocator (jemalloc, ...: its calls are not counted)."""
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily(
            "pymtrace_process_allocator_traced",
            "1 when the processes' malloc is the traced glibc, 0 when it is another allocator (jemalloc, tcmalloc, mimalloc, a static binary) whose calls are not seen",
            labels=[lab, "allocator"],
        )
        seen = {}
        for pid, p in (snap.get("processes") or {}).items():
            st = self.agg.pids.get(int(pid))
            if "allocator" in p and st is not None and st.label is not None and not p.get("exited"):
                seen[(st.label, p["allocator"])] = 1 if p.get("allocator_traced") else 0
        for key, v in sorted(seen.items()):
            fam.add_metric(list(key), v)
        return fam


def _fmt_le(v):
    from prometheus_client.utils import floatToGoString

    return floatToGoString(v)  # "1.0", "1024.0", "1.099511627776e+12": canonical for OpenMetrics


# ---------------------------------------------------------------- HTTP

INDEX = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pymtrace exporter</title></head>
<body><h1>pymtrace exporter</h1>
<p>Memory-allocation metrics from eBPF ({mode} mode, series by {label}).</p>
<p><a href="/metrics">Metrics</a></p>
<p>pymtrace {version}</p>
</body></html>
"""


class _Conn:
    """One open connection: its descriptor (to shut it down from another thread), client
    address, when it began waiting for its current request, and whether that request is
    still unauthenticated (evictable)."""

    __slots__ = ("fd", "ip", "since", "pending", "evicted")

    def __init__(self, fd, ip):
        self.fd, self.ip, self.since = fd, ip, time.monotonic()
        self.pending, self.evicted = True, False


class MetricsServer(ThreadingHTTPServer):
    """One thread per connection, TLS handshakes in that thread, and bounded resources
    that keep a scraper served under abuse:

    * each request (TLS handshake, request line, headers) must arrive whole within
      `request_timeout` of the connection (or of the previous response), not just byte by
      byte within the socket timeout;
    * at most `max_connections` connections, `max_per_client` per client address; a new
      connection beyond a cap evicts the oldest one still waiting for its request or its
      authentication (of an address that never scraped successfully, if there is one), and
      is refused only when every connection is busy with an authenticated request;
    * concurrent /metrics requests share one reading of the maps (single flight).
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    known_max, known_ttl = 1024, 600.0  # addresses that scraped successfully, remembered

    def __init__(
        self,
        address,
        registry,
        web=None,
        timeout=10.0,
        max_connections=64,
        index_html="",
        request_timeout=5.0,
        max_per_client=16,
    ):
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self.web = web
        self.conn_timeout = timeout
        self.request_timeout = request_timeout
        self.index_html = index_html
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.conns = set()
        self.known = collections.OrderedDict()  # client address -> last successful request
        self.lock = threading.Lock()
        self.rejected = self.evicted = 0
        self._render_lock = threading.Lock()
        self._rendered = {}  # content type -> [collection start, body, gzipped body]
        super().__init__(address, MetricsHandler)

    # -- admission

    def _victim(self, conns, now):
        """The connection to evict among CONNS: the oldest still waiting, preferring
        addresses that never scraped successfully; None when all are busy."""
        waiting = [c for c in conns if c.pending]
        strangers = [c for c in waiting if not self.is_known(c.ip, now)]
        return min(strangers or waiting, key=lambda c: c.since, default=None)

    def _evict(self, conn):
        conn.evicted = True
        self.evicted += 1
        try:  # shutdown() on a duplicate of the descriptor wakes the thread blocked on it
            with socket.fromfd(conn.fd, self.address_family, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _admit(self, request, ip):
        now = time.monotonic()
        with self.lock:
            live = [c for c in self.conns if not c.evicted]
            if len(self.conns) >= 2 * self.max_connections:  # evicted ones not yet gone
                return None
            for group, cap in (([c for c in live if c.ip == ip], self.max_per_client), (live, self.max_connections)):
                if len(group) >= cap:
                    victim = self._victim(group, now)
                    if victim is None:
                        return None
                    self._evict(victim)
                    live.remove(victim)
            conn = _Conn(request.fileno(), ip)
            self.conns.add(conn)
            return conn

    def open_connections(self):
        """Connections counted against the caps (evicted ones are on their way out)."""
        with self.lock:
            return sum(1 for c in self.conns if not c.evicted)

    def forget(self, conn):
        """Called by the connection's thread before it closes the socket (the descriptor
        must not be shut down once it may belong to another connection)."""
        with self.lock:
            self.conns.discard(conn)

    def set_pending(self, conn, pending):
        with self.lock:
            conn.pending = pending
            if pending:
                conn.since = time.monotonic()

    def is_known(self, ip, now=None):
        seen = self.known.get(ip)
        return seen is not None and (now or time.monotonic()) - seen < self.known_ttl

    def mark_known(self, ip):
        with self.lock:
            self.known[ip] = time.monotonic()
            self.known.move_to_end(ip)
            while len(self.known) > self.known_max:
                self.known.popitem(last=False)

    def process_request(self, request, client_address):
        conn = self._admit(request, client_address[0])
        if conn is None:
            self.rejected += 1
            self.shutdown_request(request)
            return
        t = threading.Thread(target=self._serve, args=(request, client_address, conn), daemon=True)
        try:
            t.start()
        except RuntimeError:  # cannot start a thread: shed this connection
            self.forget(conn)
            self.shutdown_request(request)

    def _serve(self, request, client_address, conn):
        try:
            self.finish_request(request, client_address, conn)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.forget(conn)
            self.shutdown_request(request)

    def finish_request(self, request, client_address, conn=None):
        # the handshake counts towards the first request's deadline
        request.settimeout(max(0.001, min(self.conn_timeout, self.request_timeout)))
        ctx = self.web.ssl_context if self.web else None
        if ctx is not None:
            try:
                request = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                request.do_handshake()
            except (ssl.SSLError, OSError, ValueError):
                if conn is not None:  # before the descriptor is closed and can be reused
                    self.forget(conn)
                request.close()
                return
        try:
            self.RequestHandlerClass(request, client_address, self, conn=conn)
        finally:
            if ctx is not None:
                if conn is not None:
                    self.forget(conn)
                try:
                    request.close()
                except OSError:
                    pass

    def handle_error(self, request, client_address):
        pass  # a client that went away is not an error worth a traceback

    # -- /metrics

    def render(self, accept, gzip_ok):
        """(body, content type, gzipped?) of /metrics. Requests that wait while the maps
        are being read share the next reading instead of queueing one each; a reading that
        began before a request arrived is never served to it."""
        encoder, ctype = choose_encoder(accept)
        arrived = time.monotonic()
        with self._render_lock:
            hit = self._rendered.get(ctype)
            if hit is None or hit[0] < arrived:
                started = time.monotonic()
                hit = self._rendered[ctype] = [started, encoder(self.registry), None]
            body = hit[1]
            if gzip_ok and len(body) > 1024:
                if hit[2] is None:
                    hit[2] = gzip.compress(body, compresslevel=5)
                return hit[2], ctype, True
        return body, ctype, False


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection: every read waits at most until the handler's
    deadline, so a request must arrive whole in time, not just each byte."""

    def __init__(self, sock, handler):
        self.sock, self.handler = sock, handler

    def readable(self):
        return True

    def readinto(self, buf):
        idle = self.handler.server.conn_timeout
        deadline = self.handler.deadline
        left = idle if deadline is None else min(idle, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError("the request did not arrive before its deadline")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buf)
        finally:
            self.sock.settimeout(idle)


class MetricsHandler(BaseHTTPRequestHandler):
    server_version = f"pymtrace-exporter/{__version__}"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # answer garbage with a real status line, not HTTP/0.9

    def __init__(self, request, client_address, server, conn=None):
        self.conn = conn
        self.deadline = (conn.since if conn else time.monotonic()) + server.request_timeout
        super().__init__(request, client_address, server)

    def setup(self):
        super().setup()
        self.connection.settimeout(self.server.conn_timeout)
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self):
        if self.deadline is None:  # keep-alive: the next request has its own deadline
            self.deadline = time.monotonic() + self.server.request_timeout
            if self.conn:
                self.server.set_pending(self.conn, True)
        try:
            super().handle_one_request()
        finally:
            self.deadline = None

    def log_message(self, fmt, *args):
        if os.environ.get("PYMTRACE_EXPORTER_ACCESS_LOG"):
            super().log_message(fmt, *args)

    def _send(self, code, body, ctype="text/plain; charset=utf-8", extra=None):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        web = self.server.web
        if web:
            for k, v in web.headers.items():
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self):
        web = self.server.web
        if web is not None and web.auth_required:
            from pymtrace.sinks import webconfig

            result = web.authenticate(self.headers.get("Authorization"), self.client_address[0])
            if result == webconfig.AUTH_LIMITED:
                self.close_connection = True
                self._send(
                    429, "Too Many Requests: too many password checks from this address\n", extra={"Retry-After": "1"}
                )
                return False
            if result != webconfig.AUTH_OK:
                self._send(401, "Unauthorized\n", extra={"WWW-Authenticate": 'Basic realm="pymtrace"'})
                return False
        if self.conn:  # authenticated: no longer evictable
            self.server.set_pending(self.conn, False)
        return True

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path == "/metrics":
            # prometheus-client picks text 0.0.4 or OpenMetrics from the Accept header.
            try:
                body, ctype, gzipped = self.server.render(
                    self.headers.get("Accept"), "gzip" in (self.headers.get("Accept-Encoding") or "")
                )
            except Exception as exc:
                self._send(500, f"collecting metrics failed: {exc}\n")
                return
            self._send(200, body, ctype, {"Content-Encoding": "gzip"} if gzipped else None)
            self.server.mark_known(self.client_address[0])
        elif path == "/":
            self._send(200, self.server.index_html, "text/html; charset=utf-8")
        else:
            self._send(404, "Not Found: try /metrics\n")

    do_HEAD = do_GET

    def do_POST(self):
        self._send(405, "Method Not Allowed\n", extra={"Allow": "GET, HEAD"})

    do_PUT = do_DELETE = do_PATCH = do_POST


def parse_listen(text):
    """HOST:PORT, :PORT, [V6]:PORT or PORT -> (host, port)."""
    text = text.strip()
    m = re.fullmatch(r"\[([0-9a-fA-F:.%\w]+)\]:(\d+)", text) or re.fullmatch(r"([^:]*):(\d+)", text)
    if m:
        host, port = m.group(1), int(m.group(2))
    elif text.isdigit():
        host, port = "", int(text)
    else:
        raise PymtraceError(f"--listen {text!r}: expected HOST:PORT, :PORT or [IPV6]:PORT")
    if not 0 <= port <= 65535:
        raise PymtraceError(f"--listen {text!r}: port out of range")
    return host, port


def make_server(
    listen, registry, web=None, timeout=10.0, index_html="", max_connections=64, request_timeout=5.0, max_per_client=16
):
    host, port = parse_listen(listen) if isinstance(listen, str) else listen
    try:
        return MetricsServer(
            (host, port),
            registry,
            web=web,
            timeout=timeout,
            index_html=index_html,
            max_connections=max_connections,
            request_timeout=request_timeout,
            max_per_client=max_per_client,
        )
    except OSError as exc:
        raise PymtraceError(f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------- command


def configure(parser):
    parser.add_argument(
        "--listen",
        default=f":{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"address to serve on (default :{DEFAULT_PORT}, all interfaces)",
    )
    parser.add_argument(
        "-p",
        "--pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="only these processes (repeatable; default: all)",
    )
    parser.add_argument("--comm", metavar="REGEX", help="only processes whose comm matches REGEX")
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="also count every malloc-API call (pymtrace_malloc_* series) with uprobes on "
        "malloc/free/...: ~2 us per malloc+free pair in every traced process (~145x "
        "a bare pair), all glibc processes of the host unless -p narrows it",
    )
    parser.add_argument(
        "--always-on",
        action="store_true",
        help="accepted for compatibility: tracepoints, USDT probes and faults only, which is now the default",
    )
    parser.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS and basic-auth settings (Prometheus exporter-toolkit web config format)",
    )
    parser.add_argument(
        "--label-by",
        choices=("comm", "cgroup", "pid"),
        default="comm",
        help="what per-process series are keyed by (default comm)",
    )
    parser.add_argument(
        "--max-series",
        type=int,
        default=None,
        metavar="N",
        help="at most N label values besides \"other\" (default 20 with --label-by pid, else 500)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="drop the series of processes gone longer than this (default 300)",
    )
    parser.add_argument(
        "--max-processes",
        type=int,
        default=None,
        metavar="N",
        help="capacity of the collectors' per-process BPF maps (LRU; default the collectors')",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="per-connection socket timeout (default 10)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a request (TLS handshake, request line, headers) must arrive whole within "
        "this time of the connection or of the previous response (default 5)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=64,
        metavar="N",
        help="concurrent connections (default 64); beyond it the oldest connection still "
        "waiting for its request or authentication is closed",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=16,
        metavar="N",
        help="concurrent connections per client address (default 16)",
    )
    parser.add_argument(
        "--no-bpf-stats", action="store_true", help="do not turn on the kernel's BPF run-time statistics"
    )


def _check_args(args):
    if args.comm:
        try:
            re.compile(args.comm)
        except re.error as exc:
            raise PymtraceError(f"--comm {args.comm!r} is not a valid regular expression: {exc}") from None
    if args.max_series is None:
        args.max_series = 20 if args.label_by == "pid" else 500
    if args.max_series < 1:
        raise PymtraceError("--max-series must be at least 1")
    if args.grace < 0:
        raise PymtraceError("--grace must be >= 0")
    if args.per_call and args.always_on:
        raise PymtraceError("--per-call and --always-on contradict each other (--always-on is the default)")
    if not (args.timeout > 0 and args.request_timeout > 0):
        raise PymtraceError("--timeout and --request-timeout must be > 0")
    if args.max_connections < 1 or args.max_connections_per_client < 1:
        raise PymtraceError("--max-connections and --max-connections-per-client must be at least 1")
    for pid in args.pid:
        if not os.path.exists(f"/proc/{pid}"):
            from pymtrace.errors import ProcessGone

            raise ProcessGone(pid)


def build_sources(args):
    """The same collectors as `pymtrace top` (pymtrace.collect.base.Collectors), attached for the
    exporter's mode: always-on (default) = slab + faults + glibc USDT, nothing on the
    malloc path; per-call = the same plus the per-call malloc uprobes."""
    from pymtrace.collect import base as collect

    bundle = collect.Collectors(pids=args.pid or None, malloc=args.per_call, slab=True, faults=True, glibc=True)
    faults = bundle.collectors.get("faults")
    if faults is not None and hasattr(faults, "regions"):
        faults.regions = False  # per-region faults are top's view 3; the exporter has no use for them
    if args.max_processes:  # capacity of the per-process maps, read by attach()
        for name in ("malloc", "faults"):
            c = bundle.collectors.get(name)
            if c is not None and hasattr(c, "max_procs"):
                c.max_procs = args.max_processes
    bundle.attach()
    for note in bundle.notes:
        print(f"pymtrace exporter: note: {note}", file=sys.stderr, flush=True)
    return [bundle]


def _close(src):
    try:
        src.close()
    except Exception:
        pass


def run(args):
    from pymtrace.bpf import load as bpfload

    _check_args(args)
    web = None
    if args.web_config:  # checked first: a broken file is reported without root or BPF
        from pymtrace.sinks import webconfig

        web = webconfig.load(args.web_config)
    bpfload.require_root("pymtrace exporter")
    mode = "per-call" if args.per_call else "always-on"
    server = make_server(
        args.listen,
        None,
        web=web,
        timeout=args.timeout,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        max_per_client=args.max_connections_per_client,
        index_html=INDEX.format(mode=mode, label=html.escape(args.label_by), version=__version__),
    )
    stats = None
    sources = []
    try:
        if not args.no_bpf_stats:
            from pymtrace.bpf.stats import BpfStats

            stats = BpfStats()
            if not stats.enable():
                print(
                    "pymtrace exporter: cannot enable BPF run-time stats; program run time will read 0", file=sys.stderr
                )
        sources = build_sources(args)
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        agg = Aggregator(
            label_by=args.label_by, max_series=args.max_series, grace=args.grace, pids=args.pid or None, comm=args.comm
        )
        registry.register(ExporterCollector(sources, agg, stats, label_by=args.label_by, mode=mode))
        server.registry = registry
        host, port = server.server_address[:2]
        scheme = "https" if web and web.ssl_context else "http"
        shown = f"[{host}]" if ":" in host else host
        print(
            f"pymtrace exporter: serving {scheme}://{shown}:{port}/metrics ({mode} mode)", file=sys.stderr, flush=True
        )
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        for s in sources:
            _close(s)
        if stats:
            stats.close()
    return 0
