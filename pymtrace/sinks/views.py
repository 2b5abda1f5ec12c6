"""The five views of `pymtrace top`, as pure functions of two snapshots.

A snapshot is the model of pymtrace.sources.snapshot (its docstring and TypedDicts are the
schema): cumulative counters since attach. PIDs may be ints or strings (a snapshot that
went through JSON has string keys). Keys of sources that are not running are absent, so
a view works with whichever sources are running: it reads the keys the schema marks as
optional with their neutral value (0, {}, None) and the rest as they are.

`build(view, prev, cur)` returns a Table: column definitions, rows of RAW values (numbers
stay numbers, for --json), a default sort column, optional grouping (a process row followed
by its region/thread rows, sorted as a unit) and plain-sentence notes. Formatting for
humans is separate (`format_rows`, `text_table`), so JSON output keeps raw numbers. A row
may carry one value after its columns, its *detail* (`row_detail`: the stacks view's full
stacks; the heap view's sentence), which sorting and filtering keep with the row and `to_json`
writes under "stacks" / "line", and after it the row's *key* (`row_key`: what it is across
snapshots, so a selection can follow it when the rows re-sort).
"""

import dataclasses
import math
import os
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Tuple, Union

from pymtrace.sinks.text import format_cell, human_bytes, human_count, printable
from pymtrace.sources import heapefficiency
from pymtrace.sources.snapshot import ALLOC_CALLS, CALLS, DELETE_CALLS, FREE_CALLS, NEW_CALLS, Snapshot

VIEWS = ("processes", "slab", "faults", "glibc", "stacks", "heap")
TITLES = {
    "processes": "processes",
    "slab": "slab caches",
    "faults": "page faults",
    "glibc": "glibc internals",
    "stacks": "call stacks",
    "heap": "heap efficiency",
}
# The snapshot's "calls" names (ALLOC_CALLS, ...) come from pymtrace.sources.snapshot, which
# reads them from the BPF headers; the MEMALIGN/s column sums this family.
MEMALIGN_FAMILY = ("memalign", "posix_memalign", "valloc", "pvalloc")


@dataclasses.dataclass(frozen=True)
class Column:
    key: str  # JSON name
    title: str  # header text
    kind: str  # "int", "str", "rate" (count/s), "bytes", "byterate" (bytes/s), "pct"
    numeric: bool = True


@dataclasses.dataclass
class Table:
    view: str
    title: str
    columns: List[Column]
    rows: List[list]  # lists of raw values, one per column
    sort: int  # index of the sort column
    reverse: bool = True  # descending
    groups: Optional[list] = None  # per row: group key (rows of a group stay together), or None
    leaders: Optional[List[bool]] = None  # per row: True for the group's leading (summary) row
    notes: List[str] = dataclasses.field(default_factory=list)
    totals: Dict[str, Any] = dataclasses.field(default_factory=dict)
    interval: float = 0.0
    lost: Dict[str, int] = dataclasses.field(default_factory=dict)  # lost-event counters, nonzero only
    shown: Optional[Callable[[list], list]] = None  # a row's values as shown (and sorted), from its raw ones

    def column_index(self, key: str) -> int:
        for i, c in enumerate(self.columns):
            if c.key == key:
                return i
        raise KeyError(key)


# --------------------------------------------------------------------------- helpers


def _by_pid(mapping: Optional[Mapping]) -> Dict[int, Any]:
    """{pid: value} with int keys whatever the snapshot used (JSON makes them strings)."""
    return {int(k): v for k, v in (mapping or {}).items()}


def _call(p: Mapping, name: str) -> int:
    """Calls of NAME in process entry P; 0 without per-call data (no malloc source)."""
    return p.get("calls", {}).get(name, 0)


def _faults(p: Mapping) -> int:
    return p.get("faults_user", 0) + p.get("faults_kernel", 0)


Snap = Union[Snapshot, Mapping[str, Any]]  # or one that went through JSON (string PIDs)


def interval_of(prev: Optional[Snap], cur: Snap, default: Optional[float] = 1.0) -> float:
    """Seconds between two snapshots (their "time" fields), else DEFAULT."""
    try:
        dt = float(cur["time"]) - float(prev["time"])
        if dt > 0:
            return dt
    except (TypeError, KeyError, ValueError):
        pass
    try:
        dt = float(cur["time"]) - float(cur["start"])
        if prev is None and dt > 0:
            return dt
    except (TypeError, KeyError, ValueError):
        pass
    return default if default and default > 0 else 1.0


def _delta(cur: float, prev: float) -> float:
    d = cur - prev
    return d if d > 0 else 0  # counters never go back; a reused PID restarts from zero


def _rate(cur: float, prev: float, dt: float) -> float:
    return _delta(cur, prev) / dt


# --------------------------------------------------------------------------- views

PROCESS_COLUMNS = [
    Column("pid", "PID", "int"),
    Column("comm", "COMM", "str", False),
    Column("malloc_per_s", "MALLOC/s", "rate"),
    Column("calloc_per_s", "CALLOC/s", "rate"),
    Column("realloc_per_s", "REALLOC/s", "rate"),
    Column("free_per_s", "FREE/s", "rate"),
    Column("memalign_per_s", "MEMALIGN/s", "rate"),
    # C++ operator new/delete: every variant summed (each one: --json's calls, the exporter)
    Column("new_per_s", "NEW/s", "rate"),
    Column("delete_per_s", "DELETE/s", "rate"),
    Column("requested_bytes_per_s", "REQ B/s", "byterate"),
    Column("mean_size", "MEAN SIZE", "bytes"),
    Column("live_bytes", "LIVE", "bytes"),
    Column("rss_anon_per_live", "ANON/LIVE", "ratio"),  # heap efficiency: view 6
    Column("faults_per_s", "FAULTS/s", "rate"),
    Column("untraced_allocator", "NOTE", "allocator", False),  # set when malloc is not glibc's
]
FAULTS_COLUMN = len(PROCESS_COLUMNS) - 2
# under --max-overhead: each row's 95 % error, after the columns it applies to
ERROR_COLUMN = Column("estimate_error_pct", "+-% (95%)", "pct")


def budget_notes(cur: Snap) -> List[str]:
    """The sentences saying that the per-call numbers are estimates under an overhead budget
    (snapshot["budget"], pymtrace.sources.budget), what the windows cost, and what is not
    measured; [] without a budget (exact counts)."""
    b = cur.get("budget")
    if not b:
        return []
    cost = b.get("cost_seconds") or {}
    measured = b.get("overhead_pct")
    windows = b.get("windows", 0)
    lines = [
        f"ESTIMATES under a {b['max_overhead_pct']:g}% overhead budget (--max-overhead): malloc's uprobes are "
        f"attached in {b['window_seconds']:g} s windows at random times, {windows} so far, "
        f"{100 * b.get('duty_cycle', 0):.2f}% of the time"
        + ("" if windows else " (the first starts within a second)")
        + ". Measured cost: "
        + (f"{measured:.2f}%" if measured is not None else "not yet known")
        + f" of the traced processes' CPU time (traps {cost.get('traps', 0):.3f} s at "
        f"{b['trap_ns_per_run']:.0f} ns a run, calibrated at start; BPF {cost.get('bpf', 0):.3f} s, kernel "
        f"statistics; attach/detach {cost.get('attach_detach', 0):.3f} s CPU).",
        "Call rates, requested bytes and sizes are each process's pace in its last window (every call "
        "counted there), carried on between windows: what tracing every call would count; +-% is their 95% "
        "error (the window's count, the spread between windows). Live bytes need every free: not measured "
        "under a budget (RSS in view 6). Without --max-overhead every call is counted (exact, at the full "
        "per-call cost).",
    ]
    saturated = sorted(
        int(pid)
        for pid, p in (cur.get("processes") or {}).items()
        if (p.get("estimate") or {}).get("saturated") and not p.get("exited")
    )
    if saturated:
        lines.append(
            "SATURATED (slowed by the traps in their last window, as by tracing every call): PID "
            + ", ".join(str(pid) for pid in saturated[:10])
            + (f" and {len(saturated) - 10} more" if len(saturated) > 10 else "")
            + ": their rates are their pace under the traps, a lower bound of their untraced pace."
        )
    if b.get("errors"):
        lines.append("Window attach errors: " + "; ".join(b["errors"]))
    return lines


def _with_error(columns: List[Column], estimated: bool) -> List[Column]:
    """COLUMNS with ERROR_COLUMN after MEAN SIZE when the numbers are ESTIMATED."""
    if not estimated:
        return columns
    at = [c.key for c in columns].index("mean_size") + 1
    return columns[:at] + [ERROR_COLUMN] + columns[at:]


def processes_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    dt = interval_of(prev, cur, interval)
    rows = []
    estimated = bool(cur.get("budget"))
    columns = _with_error(PROCESS_COLUMNS, estimated)
    error_at = columns.index(ERROR_COLUMN) if estimated else None
    tot = {"processes": 0, "calls_per_s": 0.0, "requested_bytes_per_s": 0.0, "live_bytes": 0, "faults_per_s": 0.0}
    if estimated:
        tot["estimated"] = True
    tot["older_freed_bytes"] = 0
    old_procs = _by_pid((prev or {}).get("processes"))
    for pid, p in sorted(_by_pid(cur.get("processes")).items()):
        o = old_procs.get(pid, {})
        if o and o.get("comm") not in (None, p.get("comm")) and _call(p, "malloc") < _call(o, "malloc"):
            o = {}  # PID reused by another program
        calls = {c: _delta(_call(p, c), _call(o, c)) for c in ALLOC_CALLS + FREE_CALLS}
        n_alloc = sum(calls[c] for c in ALLOC_CALLS)
        n_free = calls["free"] + sum(calls[c] for c in DELETE_CALLS)
        req = _delta(p.get("requested_bytes", 0), o.get("requested_bytes", 0))
        mean = req / n_alloc if n_alloc else None  # per interval: none when idle (blank, null)
        faults = _delta(_faults(p), _faults(o))
        traced = "calls" in p  # no per-call data (e.g. --always-on): blank, not zero
        untraced = p.get("allocator") if p.get("allocator_traced") is False else None
        traced = traced and untraced is None  # another allocator: its calls are not seen
        has_faults = "faults_user" in p or "faults_kernel" in p
        row = [
            pid,
            str(p.get("comm") or "?"),
            calls["malloc"] / dt if traced else None,
            calls["calloc"] / dt if traced else None,
            calls["realloc"] / dt if traced else None,
            calls["free"] / dt if traced else None,
            sum(calls[c] for c in MEMALIGN_FAMILY) / dt if traced else None,
            sum(calls[c] for c in NEW_CALLS) / dt if traced else None,
            sum(calls[c] for c in DELETE_CALLS) / dt if traced else None,
            req / dt if traced else None,
            mean if traced else None,
            p.get("live_bytes") if traced else None,  # absent: another allocator (sizes unknown)
            heapefficiency.assess(p)["rss_anon_per_live"] if traced else None,
            faults / dt if has_faults else None,
            untraced,
        ]
        if estimated:
            error = (p.get("estimate") or {}).get("error")
            row.insert(error_at, 100 * error if traced and error is not None else None)
        rows.append(row)
        tot["processes"] += 1
        tot["traced"] = tot.get("traced", 0) + (1 if traced else 0)
        tot["calls_per_s"] += (n_alloc + n_free) / dt
        tot["requested_bytes_per_s"] += req / dt
        tot["live_bytes"] += p.get("live_bytes") or 0
        tot["older_freed_bytes"] += max(-(p.get("live_bytes") or 0), 0)
        tot["faults_per_s"] += faults / dt
    # without per-call data (--always-on) the faults are all there is to sort by
    sort = 2 if tot.get("traced") or not rows else len(columns) - 2
    notes = budget_notes(cur) + _older_frees_note(rows, columns)
    return Table(
        "processes",
        TITLES["processes"],
        columns,
        rows,
        sort=sort,
        notes=notes,
        totals=tot,
        interval=dt,
        shown=_live_as_shown(columns),
    )


def _live_as_shown(columns: List[Column]) -> Callable[[list], list]:
    """The function giving a row of COLUMNS as shown: live bytes never below 0 (what frees of
    blocks from before attach took off is OLDER FREED, or a note), no ANON/LIVE ratio over
    fewer than heapefficiency.RATIO_MIN_LIVE_BYTES, WASTED = growth - shown live, never
    below 0. --json keeps the raw values (to_json)."""
    at = {c.key: i for i, c in enumerate(columns)}

    def shown(row: list) -> list:
        live = row[at["live_bytes"]]
        if not isinstance(live, (int, float)):
            return row
        row = list(row)
        row[at["live_bytes"]] = max(live, 0)
        if live < heapefficiency.RATIO_MIN_LIVE_BYTES:
            row[at["rss_anon_per_live"]] = None
        if "older_freed_bytes" in at:
            row[at["older_freed_bytes"]] = row[at["older_freed_bytes"]] or None  # blank, not "0 B"
        if "wasted_bytes" in at and row[at["anon_growth_bytes"]] is not None:
            row[at["wasted_bytes"]] = max(row[at["anon_growth_bytes"]] - max(live, 0), 0)
        return row

    return shown


def _older_frees_note(rows: List[list], columns: List[Column], most: int = 3) -> List[str]:
    """The note naming the processes whose frees of blocks from before attach exceed what
    they allocated since (their LIVE shows 0 B), with how much."""
    at = {c.key: i for i, c in enumerate(columns)}
    older = [(r[at["pid"]], r[at["comm"]], -r[at["live_bytes"]]) for r in rows if (r[at["live_bytes"]] or 0) < 0]
    if not older:
        return []
    older.sort(key=lambda o: -o[2])
    named = "; ".join(f"PID {pid} ({comm}) {human_bytes(n)}" for pid, comm, n in older[:most])
    more = f"; +{len(older) - most} more" if len(older) > most else ""
    return [
        f"Frees of blocks allocated before attach, beyond the bytes allocated since (LIVE shows 0 B): {named}{more}."
    ]


SLAB_COLUMNS = [
    Column("cache", "CACHE", "str", False),
    Column("allocs_per_s", "ALLOCS/s", "rate"),
    Column("frees_per_s", "FREES/s", "rate"),
    Column("bytes_per_s", "BYTES/s", "byterate"),
    Column("net_objects", "NET OBJS", "int"),
]


def _unavailable(cur: Snap, source: str) -> List[str]:
    """The note saying why COLLECTOR's data is missing (it could not run on this kernel)."""
    why = (cur.get("errors") or {}).get(source)
    return [f"Not available: {why}"] if why else []


def _size_label(key: str, caches: Iterable[str], most: int = 3) -> str:
    """'size 192: dentry, filp, ... (+8)': a row of the slab view on kernels without cache
    names; kmalloc's own caches last (kmalloc() has its own tracepoint, not counted here)."""
    names = sorted(caches, key=lambda c: ("kmalloc-" in c, c))
    more = f" (+{len(names) - most})" if len(names) > most else ""
    return f"{key}: {', '.join(names[:most])}{more}"


def slab_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    dt = interval_of(prev, cur, interval)
    old_all = (prev or {}).get("slab") or {}
    rows = []
    tot = {"caches": 0, "allocs_per_s": 0.0, "frees_per_s": 0.0, "bytes_per_s": 0.0}
    for name, s in sorted((cur.get("slab") or {}).items()):
        o = old_all.get(name, {})
        a = _rate(s["allocs"], o.get("allocs", 0), dt)
        f = _rate(s.get("frees", 0), o.get("frees", 0), dt)  # "frees": absent when not attributable
        b = _rate(s["bytes_alloc"], o.get("bytes_alloc", 0), dt)
        label = _size_label(name, s["caches"]) if s.get("caches") else str(name)  # rows by object size
        rows.append([label, a, f, b, s["allocs"] - s.get("frees", 0)])
        tot["caches"] += 1
        tot["allocs_per_s"] += a
        tot["frees_per_s"] += f
        tot["bytes_per_s"] += b
    notes = []
    if cur.get("slab_note"):  # this kernel's tracepoints lack the cache name: the fallback in use
        notes.append(f"Slab rows by {cur.get('slab_source')}: {cur['slab_note']}.")
    return Table(
        "slab",
        TITLES["slab"],
        SLAB_COLUMNS,
        rows,
        sort=1,
        notes=notes + _unavailable(cur, "slab"),
        totals=tot,
        interval=dt,
    )


FAULT_COLUMNS = [
    Column("pid", "PID", "int"),
    Column("comm", "COMM", "str", False),
    Column("region", "REGION", "str", False),
    Column("faults_per_s", "FAULTS/s", "rate"),
    Column("faults", "FAULTS", "int"),
    Column("user_per_s", "USER/s", "rate"),
    Column("kernel_per_s", "KERNEL/s", "rate"),
]
ALL_REGIONS = "(all)"


def faults_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    """One row per process (region "(all)": user + kernel faults) followed by its regions.

    Region rows count user-mode faults by the mapping they hit: a file's path, [heap],
    [stack], or anonymous mmap, as the fault source labels them.
    """
    dt = interval_of(prev, cur, interval)
    procs = _by_pid(cur.get("processes"))
    old_procs = _by_pid((prev or {}).get("processes"))
    regions = _by_pid(cur.get("fault_regions"))
    old_regions = _by_pid((prev or {}).get("fault_regions"))
    rows, groups, leaders = [], [], []
    tot = {"processes": 0, "faults_per_s": 0.0, "faults": 0}
    for pid in sorted(set(procs) | set(regions)):
        p = procs.get(pid, {})
        o = old_procs.get(pid, {})
        user, kernel = p.get("faults_user", 0), p.get("faults_kernel", 0)
        reg = regions.get(pid, {})
        if not p:  # regions without a process row: the total is the sum of the regions
            user = sum(reg.values())
        if user + kernel == 0 and not reg:
            continue
        u_rate = _rate(user, o.get("faults_user", 0), dt)
        k_rate = _rate(kernel, o.get("faults_kernel", 0), dt)
        comm = str(p.get("comm") or "?")
        rows.append([pid, comm, ALL_REGIONS, u_rate + k_rate, user + kernel, u_rate, k_rate])
        groups.append(pid)
        leaders.append(True)
        tot["processes"] += 1
        tot["faults_per_s"] += u_rate + k_rate
        tot["faults"] += user + kernel
        old_reg = old_regions.get(pid, {})
        for label, count in sorted(reg.items()):
            r = _rate(count, old_reg.get(label, 0), dt)
            rows.append([pid, comm, str(label), r, count, r, 0.0])
            groups.append(pid)
            leaders.append(False)
    return Table(
        "faults",
        TITLES["faults"],
        FAULT_COLUMNS,
        rows,
        sort=3,
        groups=groups,
        leaders=leaders,
        notes=_unavailable(cur, "faults"),
        totals=tot,
        interval=dt,
    )


GLIBC_COLUMNS = [
    Column("pid", "PID", "int"),
    Column("tid", "TID", "str", False),
    Column("comm", "COMM", "str", False),
    Column("arenas", "ARENAS", "int"),
    Column("heaps", "HEAPS", "int"),
    Column("heap_bytes", "HEAP BYTES", "bytes"),
    Column("sbrk_bytes", "SBRK TOTAL", "bytes"),
    Column("mmap_threshold", "MMAP THRESH", "bytes"),
    Column("trim_threshold", "TRIM THRESH", "bytes"),
    Column("lock_waits", "LOCK WAITS", "int"),
    Column("lock_waits_per_s", "WAITS/s", "rate"),
]


def _lock_waits(g: Mapping) -> Dict[str, int]:
    """{tid as text: arena lock waits} of glibc entry G ({} when its libc has no probes)."""
    return {str(k): v for k, v in g.get("lock_waits", {}).items()}


def _has_probes(g: Mapping) -> bool:
    """G's libc has malloc probes: "probes" > 0. An entry without the key (hand-written, as
    in tests/unit/test_views.py) is read as one with data, as the view always did."""
    return bool(g.get("probes", True))


def no_probes_sentence(
    pid: Optional[int], comm: Optional[str], g: Mapping, who: Optional[str] = None, whose: str = "its"
) -> str:
    """The plain sentence shown for a process whose libc has no malloc USDT probes (WHO:
    instead of "PID (comm)", e.g. for every process of a system-wide view)."""
    libc_path = g.get("libc")
    reason = g.get("reason")
    who = who or f"PID {pid} ({comm})"
    if not libc_path:
        why = str(reason).rstrip(".") if reason else "no libc with malloc USDT probes is mapped"
        return f"{who}: glibc allocator internals are not available ({why})."
    where = f"{whose} libc {libc_path}"
    text = f"{who}: {where} has no malloc USDT probes, so glibc allocator internals are not available"
    if reason:
        reason = str(reason).rstrip(".")
        if libc_path and reason.startswith(f"libc {libc_path} has no USDT probes"):
            reason = reason[len(f"libc {libc_path} has no USDT probes") :].strip(" ()")
        elif libc_path and libc_path in reason:
            reason = reason.replace(f" {libc_path}", "")
        if reason:
            text += f" ({reason})" if not reason.startswith("(") else f" {reason}"
    return text + "."


def glibc_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    """Per process: arenas, heaps, sbrk, thresholds, lock waits; then one row per waiting thread."""
    dt = interval_of(prev, cur, interval)
    procs = _by_pid(cur.get("processes"))
    glibc = _by_pid(cur.get("glibc"))
    old_glibc = _by_pid((prev or {}).get("glibc"))
    rows, groups, leaders, notes = [], [], [], []
    tot = {"processes": 0, "without_probes": 0, "lock_waits_per_s": 0.0}
    for pid in sorted(glibc):
        g = glibc[pid]
        p = procs.get(pid, {})
        comm = str(g.get("comm") or p.get("comm") or "?")
        if not _has_probes(g):
            notes.append(no_probes_sentence(pid, comm, g))
            tot["without_probes"] += 1
            continue
        if g.get("reason"):
            notes.append(f"PID {pid} ({comm}): {str(g['reason']).rstrip('.')}.")
        waits = _lock_waits(g)
        old_waits = _lock_waits(old_glibc.get(pid, {}))
        total_waits = sum(waits.values())
        w_rate = _rate(total_waits, sum(old_waits.values()), dt)
        rows.append(
            [
                pid,
                "",
                comm,
                g.get("arenas", 0),
                g.get("heaps", 0),
                g.get("heap_bytes", 0),
                g.get("sbrk_bytes", 0),
                g.get("mmap_threshold"),  # None: unknown (blank, null in JSON)
                g.get("trim_threshold"),
                total_waits,
                w_rate,
            ]
        )
        groups.append(pid)
        leaders.append(True)
        tot["processes"] += 1
        tot["lock_waits_per_s"] += w_rate
        for tid, n in sorted(waits.items(), key=lambda kv: _tid_key(kv[0])):
            rows.append([pid, tid, comm, None, None, None, None, None, None, n, _rate(n, old_waits.get(tid, 0), dt)])
            groups.append(pid)
            leaders.append(False)
    probeless = _probeless_libcs(cur) if not glibc else []
    for info in probeless:  # system-wide: no libc in use has probes, so no process is listed
        notes.append(no_probes_sentence(None, None, info, who="every process (system-wide)", whose="the"))
    tot["libcs_without_probes"] = len(probeless)
    if not glibc and not probeless:
        notes.append("No process is being watched through glibc's malloc probes yet.")
    return Table(
        "glibc",
        TITLES["glibc"],
        GLIBC_COLUMNS,
        rows,
        sort=0,
        reverse=False,
        groups=groups,
        leaders=leaders,
        notes=notes,
        totals=tot,
        interval=dt,
    )


def _probeless_libcs(cur: Snap) -> List[Mapping]:
    """The libcs the glibc source looked at, when none of them had probes to attach."""
    libcs = cur.get("glibc_collector", {}).get("libcs", [])
    return [] if any(i["attached"] for i in libcs) else libcs


def _tid_key(tid: Union[int, str]) -> Tuple[int, Union[int, str]]:
    try:
        return (0, int(tid))
    except (TypeError, ValueError):
        return (1, str(tid))


STACK_COLUMNS = [
    Column("pid", "PID", "int"),
    Column("comm", "COMM", "str", False),
    Column("site", "CALL SITE", "str", False),
    Column("module", "FILE", "str", False),
    Column("alloc_bytes_per_s", "ALLOC B/s", "byterate"),
    Column("allocs_per_s", "ALLOCS/s", "rate"),
    Column("inuse_bytes", "IN USE", "bytes"),
    Column("alloc_bytes", "TOTAL", "bytes"),
    Column("stacks", "STACKS", "int"),
]
DETAIL_ROWS = 5  # --batch prints the hottest stack of this many call sites
STACKS_NOT_ENABLED = (
    "Call stacks are not being sampled: start top with --stacks -p PID "
    "(the heap sampler attaches to the chosen processes only)."
)


def _stack_detail(stack: Mapping, old: Optional[Mapping], dt: float) -> Dict[str, Any]:
    """One stack of a call site, with its rates over the interval (frames root first)."""
    o = old or {}
    return {
        "id": stack.get("id"),
        "alloc_bytes_per_s": _rate(stack["alloc_bytes"], o.get("alloc_bytes", 0), dt),
        "allocs_per_s": _rate(stack["alloc_objects"], o.get("alloc_objects", 0), dt),
        "inuse_bytes": stack["inuse_bytes"],
        "inuse_objects": stack["inuse_objects"],
        "alloc_bytes": stack["alloc_bytes"],
        "alloc_objects": stack["alloc_objects"],
        "samples": stack["samples"],
        "complete": stack["complete"],
        "frames": list(stack["frames"]),
    }


def stacks_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    """One row per call site (the first frame outside libc/libstdc++) of the sampled processes:
    estimated allocation rates over the interval, sampled bytes still in use, bytes since
    attach; the row's detail holds its stacks, root first, hottest first."""
    dt = interval_of(prev, cur, interval)
    procs = _by_pid(cur.get("processes"))
    stacks = _by_pid(cur.get("stacks"))
    old_stacks = _by_pid((prev or {}).get("stacks"))
    rows, notes = [], []
    tot = {"processes": 0, "sites": 0, "alloc_bytes_per_s": 0.0, "allocs_per_s": 0.0, "inuse_bytes": 0.0}
    tot.update(samples=0, complete_samples=0)
    if "stacks" not in cur:
        notes.append(STACKS_NOT_ENABLED)
    for pid, sp in sorted(stacks.items()):
        comm = str(sp.get("comm") or procs.get(pid, {}).get("comm") or "?")
        old_sites = old_stacks.get(pid, {}).get("sites", {})
        tot["processes"] += 1
        tot["samples"] += sp["samples"]
        tot["complete_samples"] += sp["complete_samples"]
        tot["sample_bytes"] = sp["sample_bytes"]
        for key, site in sp["sites"].items():
            o = old_sites.get(key, {})
            old_by_id = {st.get("id"): st for st in o.get("stacks", ())}
            bytes_rate = _rate(site["alloc_bytes"], o.get("alloc_bytes", 0), dt)
            calls_rate = _rate(site["alloc_objects"], o.get("alloc_objects", 0), dt)
            detail = [_stack_detail(st, old_by_id.get(st.get("id")), dt) for st in site["stacks"]]
            detail.sort(key=lambda d: (d["alloc_bytes_per_s"], d["alloc_bytes"]), reverse=True)
            row = [pid, comm, site["function"], site["module"], bytes_rate, calls_rate]
            rows.append(row + [site["inuse_bytes"], site["alloc_bytes"], len(detail), detail, (pid, key)])
            tot["sites"] += 1
            tot["alloc_bytes_per_s"] += bytes_rate
            tot["allocs_per_s"] += calls_rate
            tot["inuse_bytes"] += site["inuse_bytes"]
        if sp.get("overflow_samples"):
            notes.append(
                f"PID {pid} ({comm}): more than {sp['max_stacks']} distinct stacks; the samples of later "
                f"new stacks ({sp['overflow_samples']} so far) are counted under [other stacks]."
            )
    if stacks and tot["samples"] > tot["complete_samples"]:
        notes.append(
            f"{tot['samples'] - tot['complete_samples']} of {tot['samples']} samples have stacks that did not "
            "reach the outermost frame (deeper than the stack copy, or in code without unwind tables)."
        )
    return Table("stacks", TITLES["stacks"], STACK_COLUMNS, rows, sort=4, notes=notes, totals=tot, interval=dt)


HEAP_COLUMNS = [
    Column("pid", "PID", "int"),
    Column("comm", "COMM", "str", False),
    Column("live_bytes", "LIVE", "bytes"),
    Column("older_freed_bytes", "OLDER FREED", "bytes"),
    Column("anon_growth_bytes", "ANON GROWTH", "bytes"),
    Column("rss_anon_bytes", "RSS ANON", "bytes"),
    Column("rss_bytes", "RSS", "bytes"),
    Column("rss_anon_per_live", "ANON/LIVE", "ratio"),
    Column("wasted_bytes", "WASTED", "bytes"),
    Column("glibc_heap_bytes", "GLIBC HEAP", "bytes"),
    Column("flag", "FLAG", "str", False),
]
HEAP_NOTE = (
    "LIVE: allocated minus freed bytes since attach (glibc: chunk bytes; other allocators: requested "
    "bytes, kept per block), never below 0; OLDER FREED: what frees of blocks allocated before attach "
    "took below 0; ANON GROWTH: RssAnon now minus at attach; ANON/LIVE only over "
    f"{heapefficiency.RATIO_MIN_LIVE_BYTES >> 20} MiB live; WASTED = growth - live; flagged when growth > "
    f"{heapefficiency.WASTE_RATIO:g}x live and wasted > {heapefficiency.WASTE_MIN_BYTES >> 20} MiB."
)


BUDGET_HEAP_NOTE = (
    "Under --max-overhead malloc's probes are attached in windows only: live bytes (which need every free "
    "seen) are not measured; RSS, RSS ANON and their growth since attach are."
)


def heap_view(prev: Optional[Snap], cur: Snap, interval: Optional[float] = None) -> Table:
    """Heap efficiency: per process, live malloc bytes beside its anonymous and total RSS,
    their ratio, and a flag (with what to try, in the notes) when RSS is far above them."""
    dt = interval_of(prev, cur, interval)
    glibc = _by_pid(cur.get("glibc"))
    rows, notes = [], []
    tot = {"processes": 0, "flagged": 0, "live_bytes": 0, "older_freed_bytes": 0, "rss_anon_bytes": 0, "rss_bytes": 0}
    for pid, p in sorted(_by_pid(cur.get("processes")).items()):
        if "rss_bytes" not in p:
            continue
        a = heapefficiency.assess(p)
        g = glibc.get(pid) or {}
        arena = g.get("sbrk_bytes", 0) + g.get("heap_bytes", 0) if _has_probes(g) and g else None
        live = p.get("live_bytes")
        comm = str(p.get("comm") or "?")
        flag = {True: "FRAGMENTED?", False: ""}.get(a["heap_flag"], "no live bytes")
        rows.append(
            [
                pid,
                comm,
                live,
                a["older_freed_bytes"],
                a["anon_growth_bytes"],
                p["rss_anon_bytes"],
                p["rss_bytes"],
                a["rss_anon_per_live"],
                a["wasted_bytes"],
                arena,
                flag,
                heapefficiency.describe(pid, comm, p, g or None),  # detail: the full screen's selected row
                pid,  # key
            ]
        )
        if a["heap_flag"]:
            notes.append(heapefficiency.flag_line(pid, comm, p, g or None))
            tot["flagged"] += 1
        tot["processes"] += 1
        tot["live_bytes"] += live or 0
        tot["older_freed_bytes"] += a["older_freed_bytes"] or 0
        tot["rss_anon_bytes"] += p["rss_anon_bytes"]
        tot["rss_bytes"] += p["rss_bytes"]
    if cur.get("budget"):
        notes.append(BUDGET_HEAP_NOTE)
    notes.append(HEAP_NOTE)
    return Table(
        "heap",
        TITLES["heap"],
        HEAP_COLUMNS,
        rows,
        sort=[c.key for c in HEAP_COLUMNS].index("wasted_bytes"),
        notes=notes,
        totals=tot,
        interval=dt,
        shown=_live_as_shown(HEAP_COLUMNS),
    )


def row_detail(table: Table, row: list) -> Any:
    """The detail a row carries after its columns (the stacks view: its stacks; the heap
    view: its sentence), or None."""
    return row[len(table.columns)] if len(row) > len(table.columns) else None


def row_key(table: Table, row: list) -> Hashable:
    """What ROW is across snapshots: the key it carries after its detail (the stacks view: (PID,
    site key); the heap view: its PID), else its first value."""
    n = len(table.columns)
    return row[n + 1] if len(row) > n + 1 else row[0]


def frame_text(frame: Mapping) -> str:
    """One frame of a stack for humans: 'function (file:line) [inlined]', or 'function (module)'."""
    where = f"{os.path.basename(frame['file'])}:{frame['line']}" if frame.get("file") else frame.get("module", "")
    text = f"{frame['function']} ({where})" if where else str(frame["function"])
    return printable(text + (" [inlined]" if frame.get("inlined") else ""))


def detail_lines(table: Table, row: list, most: int = 3) -> List[str]:
    """The stacks of a stacks-view ROW as text lines: the MOST hottest, each root to leaf."""
    stacks = row_detail(table, row) or []
    lines = [printable(f"{row[2]} in {row[3] or '?'} (PID {row[0]}): {len(stacks)} stack(s)")]
    for i, st in enumerate(stacks[:most]):
        complete = "" if st["complete"] else ", incomplete"
        lines.append(
            f"  stack {i + 1}: {human_bytes(st['alloc_bytes_per_s'])}/s, {human_count(st['allocs_per_s'])} calls/s, "
            f"{human_bytes(st['inuse_bytes'])} in use, {human_bytes(st['alloc_bytes'])} total{complete}"
        )
        lines.extend(f"    {frame_text(f)}" for f in st["frames"])
    if len(stacks) > most:
        lines.append(f"  (+{len(stacks) - most} more stacks)")
    return lines


_BUILDERS = {
    "processes": processes_view,
    "slab": slab_view,
    "faults": faults_view,
    "glibc": glibc_view,
    "stacks": stacks_view,
    "heap": heap_view,
}


def view_name(view: Union[int, str]) -> str:
    """'processes' for 1, '1', 'processes'; raises ValueError otherwise."""
    if isinstance(view, int) or (isinstance(view, str) and view.isdigit()):
        i = int(view)
        if 1 <= i <= len(VIEWS):
            return VIEWS[i - 1]
    elif view in VIEWS:
        return view
    raise ValueError(f"unknown view {view!r} (use 1-{len(VIEWS)} or one of {', '.join(VIEWS)})")


def build(
    view: Union[int, str],
    prev: Optional[Snap],
    cur: Optional[Snap],
    interval: Optional[float] = None,
    sort: Union[int, str, None] = None,
    reverse: Optional[bool] = None,
) -> Table:
    """The Table of VIEW (1-5 or a name) from snapshot PREV (None at start) to CUR, sorted.

    sort: a column index or key overriding the view's default; reverse: descending or not.
    """
    table = _BUILDERS[view_name(view)](prev, cur or {}, interval)
    if sort is not None:
        table.sort = sort if isinstance(sort, int) else table.column_index(sort)
        table.sort %= len(table.columns)
    if reverse is not None:
        table.reverse = bool(reverse)
    sort_rows(table)
    table.lost = _lost(cur or {})
    table.notes.extend(str(n) for n in (cur or {}).get("notes") or ())
    return table


def build_all(prev: Optional[Snap], cur: Optional[Snap], interval: Optional[float] = None) -> Dict[str, Table]:
    return {name: build(name, prev, cur, interval) for name in VIEWS}


def _lost(cur: Snap) -> Dict[str, int]:
    return {str(k): v for k, v in cur.get("lost", {}).items() if v}


# --------------------------------------------------------------------------- totals

# The `totals` view of top (--batch/--json): exact cumulative counters since attach.
TOTAL_COLUMNS = (
    ("pid", "PID"),
    ("comm", "COMM"),
    *((c, "FREE(NULL)" if c == "free_null" else c.upper()) for c in CALLS),
    ("requested_bytes", "REQUESTED"),
    ("allocated_bytes", "ALLOCATED"),
    ("freed_bytes", "FREED"),
    ("live_bytes", "LIVE"),
    ("failed", "FAILED"),
    ("faults_user", "FAULTS_USER"),
    ("faults_kernel", "FAULTS_KERNEL"),
)


_BLOCK_BYTES = ("allocated_bytes", "freed_bytes", "live_bytes")


def totals_rows(snap: Snap, pids: Optional[List[int]] = None) -> List[list]:
    """Exact cumulative counters per process (the `totals` view): [[values]], sorted by PID;
    a counter of a source that is not running is 0."""
    rows = []
    for pid, p in sorted(_by_pid(snap.get("processes")).items()):
        if pids and pid not in pids:
            continue
        calls = p.get("calls", {})
        row = []
        for key, _ in TOTAL_COLUMNS:
            if key == "pid":
                row.append(pid)
            elif key == "comm":
                row.append(p["comm"])
            elif key in CALLS:
                row.append(int(calls.get(key, 0)))
            elif key in _BLOCK_BYTES and calls and key not in p:
                row.append(None)  # counted on another allocator than glibc: block sizes unknown
            else:
                row.append(int(p.get(key, 0)))
        rows.append(row)
    return rows


def printable_rows(rows: List[list]) -> List[list]:
    """ROWS (of totals_rows) with their names escaped for a terminal (text.printable)."""
    return [[printable(v) if isinstance(v, str) else v for v in row] for row in rows]


# --------------------------------------------------------------------------- sorting


def _sort_value(table: Table, row: list) -> Tuple[int, Union[int, float, str]]:
    v = (table.shown(row) if table.shown else row)[table.sort]
    col = table.columns[table.sort]
    if col.numeric:
        return (0, v if isinstance(v, (int, float)) else -math.inf)
    return (1, str(v).lower())


def sort_rows(table: Table) -> Table:
    """Sort TABLE.rows in place by TABLE.sort (descending when TABLE.reverse).

    Grouped tables keep each group together: groups are ordered by their leading row's
    value, rows inside a group by their own value, the leading row first. Ties are
    broken by the original order (stable), which is by PID/name.
    """
    if not table.rows:
        return table
    if not table.groups:
        table.rows.sort(key=lambda r: _sort_value(table, r), reverse=table.reverse)
        return table
    grouped = {}
    order = []
    for row, g, lead in zip(table.rows, table.groups, table.leaders or [False] * len(table.rows)):
        if g not in grouped:
            grouped[g] = [None, []]
            order.append(g)
        if lead and grouped[g][0] is None:
            grouped[g][0] = row
        else:
            grouped[g][1].append(row)

    def group_key(g: Hashable) -> Tuple[int, Union[int, float, str]]:
        lead, members = grouped[g]
        return _sort_value(table, lead if lead is not None else members[0])

    order.sort(key=group_key, reverse=table.reverse)
    rows, groups, leaders = [], [], []
    for g in order:
        lead, members = grouped[g]
        members.sort(key=lambda r: _sort_value(table, r), reverse=table.reverse)
        if lead is not None:
            rows.append(lead)
            groups.append(g)
            leaders.append(True)
        for r in members:
            rows.append(r)
            groups.append(g)
            leaders.append(False)
    table.rows, table.groups, table.leaders = rows, groups, leaders
    return table


# --------------------------------------------------------------------------- formatting


def format_rows(table: Table) -> List[List[str]]:
    """Rows as strings for humans (bytes as KiB/MiB/..., rates with k/M suffixes).

    In grouped tables the non-leading rows of a group leave PID/COMM blank and indent
    their label, like a tree under the process row.
    """
    out = []
    leaders = table.leaders or [True] * len(table.rows)
    for row, lead in zip(table.rows, leaders):
        if table.shown:
            row = table.shown(row)
        cells = [format_cell(c.kind, v) for c, v in zip(table.columns, row)]
        if table.groups and not lead:
            for i, c in enumerate(table.columns):
                if c.key in ("pid", "comm"):
                    cells[i] = ""
                elif c.key in ("region", "tid"):
                    cells[i] = "  " + cells[i]
        out.append(cells)
    return out


def headers(table: Table, mark_sort: bool = True) -> List[str]:
    heads = []
    for i, c in enumerate(table.columns):
        t = c.title
        if mark_sort and i == table.sort:
            t += "v" if table.reverse else "^"
        heads.append(t)
    return heads


def summary(table: Table) -> str:
    """One line of totals for the header of the view."""
    t = table.totals
    if table.view == "processes":
        if t.get("estimated"):
            text = (
                f"{t.get('processes', 0)} processes, ~{human_count(t.get('calls_per_s', 0))} calls/s, "
                f"~{human_bytes(t.get('requested_bytes_per_s', 0))}/s requested (ESTIMATES under an overhead "
                f"budget), {human_count(t.get('faults_per_s', 0))} faults/s"
            )
        elif t.get("traced", 0) or not t.get("processes"):
            text = (
                f"{t.get('processes', 0)} processes, {human_count(t.get('calls_per_s', 0))} calls/s, "
                f"{human_bytes(t.get('requested_bytes_per_s', 0))}/s requested, "
                f"{_live_text(t)}, {human_count(t.get('faults_per_s', 0))} faults/s"
            )
        else:
            text = (
                f"{t.get('processes', 0)} processes, {human_count(t.get('faults_per_s', 0))} faults/s "
                "(no per-call malloc data: per-call probes are off)"
            )
    elif table.view == "slab":
        text = (
            f"{t.get('caches', 0)} caches, {human_count(t.get('allocs_per_s', 0))} allocs/s, "
            f"{human_count(t.get('frees_per_s', 0))} frees/s, {human_bytes(t.get('bytes_per_s', 0))}/s"
        )
    elif table.view == "faults":
        text = f"{t.get('processes', 0)} processes, {human_count(t.get('faults_per_s', 0))} faults/s, {t.get('faults', 0)} since attach"
    elif table.view == "heap":
        text = (
            f"{t.get('processes', 0)} processes, {_live_text(t)}, "
            f"{human_bytes(t.get('rss_anon_bytes', 0))} anon RSS, {human_bytes(t.get('rss_bytes', 0))} RSS, "
            f"{t.get('flagged', 0)} flagged"
        )
    elif table.view == "stacks":
        text = (
            f"{t.get('sites', 0)} call sites in {t.get('processes', 0)} processes, "
            f"{human_bytes(t.get('alloc_bytes_per_s', 0))}/s, {human_count(t.get('allocs_per_s', 0))} allocs/s, "
            f"{human_bytes(t.get('inuse_bytes', 0))} in use"
        )
        if t.get("sample_bytes"):
            every = "every call" if t["sample_bytes"] <= 1 else f"1 per {human_bytes(t['sample_bytes'])} (estimates)"
            text += f"; {t.get('samples', 0)} samples, {every}"
    elif t.get("libcs_without_probes") and not t.get("processes") and not t.get("without_probes"):
        n = t["libcs_without_probes"]
        text = (
            "the libc in use has no" if n == 1 else f"none of the {n} libcs in use has"
        ) + " malloc USDT probes: no glibc internals to show (see below)"
    else:
        text = (
            f"{t.get('processes', 0)} processes with probes, {t.get('without_probes', 0)} without, "
            f"{human_count(t.get('lock_waits_per_s', 0))} arena lock waits/s"
        )
    lost = getattr(table, "lost", None)
    if lost:
        text += ", LOST " + ", ".join(f"{k}={v}" for k, v in sorted(lost.items()))
    return text


def _live_text(totals: Mapping[str, Any]) -> str:
    """The totals' live bytes as shown (each process's never below 0), and the older frees apart."""
    older = totals.get("older_freed_bytes", 0)
    text = f"{human_bytes(totals.get('live_bytes', 0) + older)} live"
    return text + (f" ({human_bytes(older)} of older blocks freed)" if older else "")


def text_table(table: Table, tablefmt: str = "simple") -> str:
    """The table as plain text (tabulate), with the notes below it: for --batch."""
    from tabulate import tabulate

    numeric = [c.numeric for c in table.columns]
    lines = [f"== {table.title}: {summary(table)}"]
    if table.rows:
        lines.append(
            tabulate(
                format_rows(table),
                headers=headers(table, mark_sort=False),
                tablefmt=tablefmt,
                colalign=["right" if n else "left" for n in numeric],
                disable_numparse=True,
            )
        )
    else:
        lines.append("(no activity)" if not table.notes else "")
    if table.view == "stacks":  # the hottest stack of the first call sites, root to leaf
        for row in table.rows[:DETAIL_ROWS]:
            lines.extend(detail_lines(table, row, most=1))
    lines.extend(printable(note) for note in table.notes)
    return "\n".join(line for line in lines if line != "")


def to_json(table: Table) -> Dict[str, Any]:
    """A JSON-able dict with raw numbers (no units, no rounding): for --json."""
    keys = [c.key for c in table.columns]
    rows = []
    leaders = table.leaders or [None] * len(table.rows)
    for row, lead in zip(table.rows, leaders):
        d = {k: v for k, v in zip(keys, row)}
        if table.groups:
            if table.view == "glibc":
                if lead:
                    d.pop("tid", None)
                else:
                    d = {k: v for k, v in d.items() if k in ("pid", "tid", "comm", "lock_waits", "lock_waits_per_s")}
            d["kind"] = "process" if lead else ("region" if table.view == "faults" else "thread")
        if table.view == "stacks":
            d["stacks"] = row_detail(table, row) or []
        elif table.view == "heap":
            d["line"] = row_detail(table, row)
        rows.append(d)
    return {
        "view": table.view,
        "interval": table.interval,
        "columns": keys,
        "sort": keys[table.sort],
        "descending": table.reverse,
        "rows": rows,
        "totals": dict(table.totals),
        "notes": list(table.notes),
        "lost": dict(getattr(table, "lost", {}) or {}),
    }
