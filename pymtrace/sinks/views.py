"""The four views of `pymtrace top`, as pure functions of two snapshots.

A snapshot is the JSON-able dict the collectors produce (cumulative counters since attach):

    {"time": monotonic_seconds,
     "processes": {pid: {"pid", "comm", "calls": {"malloc", "calloc", "realloc", "free",
                         "free_null", "memalign", "posix_memalign", "valloc", "pvalloc"},
                         "requested_bytes", "allocated_bytes", "freed_bytes", "live_bytes",
                         "failed", "size_log2": [...], "faults_user", "faults_kernel"}},
     "slab": {cache: {"allocs", "frees", "bytes_alloc", "bytes_req"}},  # or {"size N": {...,
         # "caches": [names]}} on kernels without cache names (see "slab_source", "slab_note")
     "fault_regions": {pid: {region_label: count}},
     "glibc": {pid: {"arenas", "heaps", "heap_bytes", "sbrk_bytes", "mmap_threshold",
                     "trim_threshold", "lock_waits": {tid: n}, ...} or {"probes": 0, "reason"}},
     "lost": {name: count}}

PIDs may be ints or strings (a snapshot that went through JSON has string keys). Missing
keys count as zero, so a view works with whichever collectors are running.

`build(view, prev, cur)` returns a Table: column definitions, rows of RAW values (numbers
stay numbers, for --json), a default sort column, optional grouping (a process row followed
by its region/thread rows, sorted as a unit) and plain-sentence notes. Formatting for
humans is separate (`format_rows`, `text_table`), so JSON output keeps raw numbers.
"""

import dataclasses
import math

VIEWS = ("processes", "slab", "faults", "glibc")
TITLES = {
    "processes": "processes",
    "slab": "slab caches",
    "faults": "page faults",
    "glibc": "glibc internals",
}
# The snapshot's "calls" names in display order: the names are collect.call_names() (from the
# BPF headers; tests/unit/test_contract.py checks they agree), the order is this view's choice.
CALLS = ("malloc", "calloc", "realloc", "free", "free_null", "memalign", "posix_memalign", "valloc", "pvalloc")
MEMALIGN_FAMILY = ("memalign", "posix_memalign", "valloc", "pvalloc")
ALLOC_CALLS = tuple(c for c in CALLS if c not in ("free", "free_null"))


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
    columns: list
    rows: list  # lists of raw values, one per column
    sort: int  # index of the sort column
    reverse: bool = True  # descending
    groups: list = None  # per row: group key (rows of a group stay together), or None
    leaders: list = None  # per row: True for the group's leading (summary) row
    notes: list = dataclasses.field(default_factory=list)
    totals: dict = dataclasses.field(default_factory=dict)
    interval: float = 0.0
    lost: dict = dataclasses.field(default_factory=dict)  # lost-event counters, nonzero only

    def column_index(self, key):
        for i, c in enumerate(self.columns):
            if c.key == key:
                return i
        raise KeyError(key)


# --------------------------------------------------------------------------- helpers


def _num(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    return 0


def _get(d, *path):
    for p in path:
        if not isinstance(d, dict):
            return 0
        d = d.get(p, 0)
    return _num(d)


def _by_pid(mapping):
    """{pid: value} with int keys whatever the snapshot used."""
    out = {}
    for k, v in (mapping or {}).items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            continue
    return out


def interval_of(prev, cur, default=1.0):
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


def _delta(cur, prev):
    d = _num(cur) - _num(prev)
    return d if d > 0 else 0  # counters never go back; a reused PID restarts from zero


def _rate(cur, prev, dt):
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
    Column("requested_bytes_per_s", "REQ B/s", "byterate"),
    Column("mean_size", "MEAN SIZE", "bytes"),
    Column("live_bytes", "LIVE", "bytes"),
    Column("faults_per_s", "FAULTS/s", "rate"),
    Column("untraced_allocator", "NOTE", "allocator", False),  # set when malloc is not glibc's
]
FAULTS_COLUMN = len(PROCESS_COLUMNS) - 2


def _old_row(old_procs, pid):
    """PID's entry in the previous snapshot's processes (OLD_PROCS: _by_pid of them), or {}."""
    old = old_procs.get(pid)
    return old if isinstance(old, dict) else {}


def processes_view(prev, cur, interval=None):
    dt = interval_of(prev, cur, interval)
    rows = []
    tot = {"processes": 0, "calls_per_s": 0.0, "requested_bytes_per_s": 0.0, "live_bytes": 0, "faults_per_s": 0.0}
    old_procs = _by_pid((prev or {}).get("processes"))
    for pid, p in sorted(_by_pid(cur.get("processes")).items()):
        if not isinstance(p, dict):
            continue
        o = _old_row(old_procs, pid)
        if o and o.get("comm") not in (None, p.get("comm")) and _get(p, "calls", "malloc") < _get(o, "calls", "malloc"):
            o = {}  # PID reused by another program
        calls = {c: _delta(_get(p, "calls", c), _get(o, "calls", c)) for c in ALLOC_CALLS + ("free",)}
        n_alloc = sum(calls[c] for c in ALLOC_CALLS)
        req = _delta(_get(p, "requested_bytes"), _get(o, "requested_bytes"))
        mean = req / n_alloc if n_alloc else None  # per interval: none when idle (blank, null)
        faults = _delta(
            _get(p, "faults_user") + _get(p, "faults_kernel"), _get(o, "faults_user") + _get(o, "faults_kernel")
        )
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
            req / dt if traced else None,
            mean if traced else None,
            _get(p, "live_bytes") if traced else None,
            faults / dt if has_faults else None,
            untraced,
        ]
        rows.append(row)
        tot["processes"] += 1
        tot["traced"] = tot.get("traced", 0) + (1 if traced else 0)
        tot["calls_per_s"] += (n_alloc + calls["free"]) / dt
        tot["requested_bytes_per_s"] += req / dt
        tot["live_bytes"] += _get(p, "live_bytes")
        tot["faults_per_s"] += faults / dt
    # without per-call data (--always-on) the faults are all there is to sort by
    sort = 2 if tot.get("traced") or not rows else FAULTS_COLUMN
    return Table("processes", TITLES["processes"], PROCESS_COLUMNS, rows, sort=sort, totals=tot, interval=dt)


SLAB_COLUMNS = [
    Column("cache", "CACHE", "str", False),
    Column("allocs_per_s", "ALLOCS/s", "rate"),
    Column("frees_per_s", "FREES/s", "rate"),
    Column("bytes_per_s", "BYTES/s", "byterate"),
    Column("net_objects", "NET OBJS", "int"),
]


def _unavailable(cur, collector):
    """The note saying why COLLECTOR's data is missing (it could not run on this kernel)."""
    why = (cur.get("errors") or {}).get(collector)
    return [f"Not available: {why}"] if why else []


def _size_label(key, caches, most=3):
    """'size 192: dentry, filp, ... (+8)': a row of the slab view on kernels without cache
    names; kmalloc's own caches last (kmalloc() has its own tracepoint, not counted here)."""
    names = sorted(caches, key=lambda c: ("kmalloc-" in c, c))
    more = f" (+{len(names) - most})" if len(names) > most else ""
    return f"{key}: {', '.join(names[:most])}{more}"


def slab_view(prev, cur, interval=None):
    dt = interval_of(prev, cur, interval)
    old_all = (prev or {}).get("slab") or {}
    rows = []
    tot = {"caches": 0, "allocs_per_s": 0.0, "frees_per_s": 0.0, "bytes_per_s": 0.0}
    for name, s in sorted((cur.get("slab") or {}).items()):
        if not isinstance(s, dict):
            continue
        o = old_all.get(name) or {}
        a = _rate(_get(s, "allocs"), _get(o, "allocs"), dt)
        f = _rate(_get(s, "frees"), _get(o, "frees"), dt)
        b = _rate(_get(s, "bytes_alloc"), _get(o, "bytes_alloc"), dt)
        label = _size_label(name, s["caches"]) if s.get("caches") else str(name)  # rows by object size
        rows.append([label, a, f, b, _get(s, "allocs") - _get(s, "frees")])
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


def faults_view(prev, cur, interval=None):
    """One row per process (region "(all)": user + kernel faults) followed by its regions.

    Region rows count user-mode faults by the mapping they hit: a file's path, [heap],
    [stack], or anonymous mmap, as the fault collector labels them.
    """
    dt = interval_of(prev, cur, interval)
    procs = _by_pid(cur.get("processes"))
    old_procs = _by_pid((prev or {}).get("processes"))
    regions = _by_pid(cur.get("fault_regions"))
    old_regions = _by_pid((prev or {}).get("fault_regions"))
    rows, groups, leaders = [], [], []
    tot = {"processes": 0, "faults_per_s": 0.0, "faults": 0}
    for pid in sorted(set(procs) | set(regions)):
        p = procs.get(pid) if isinstance(procs.get(pid), dict) else {}
        o = _old_row(old_procs, pid)
        user, kernel = _get(p, "faults_user"), _get(p, "faults_kernel")
        reg = regions.get(pid) if isinstance(regions.get(pid), dict) else {}
        if not p:  # regions without a process row: the total is the sum of the regions
            user = sum(_num(v) for v in reg.values())
        if user + kernel == 0 and not reg:
            continue
        u_rate = _rate(user, _get(o, "faults_user"), dt)
        k_rate = _rate(kernel, _get(o, "faults_kernel"), dt)
        comm = str(p.get("comm") or "?")
        rows.append([pid, comm, ALL_REGIONS, u_rate + k_rate, user + kernel, u_rate, k_rate])
        groups.append(pid)
        leaders.append(True)
        tot["processes"] += 1
        tot["faults_per_s"] += u_rate + k_rate
        tot["faults"] += user + kernel
        old_reg = old_regions.get(pid) if isinstance(old_regions.get(pid), dict) else {}
        for label, count in sorted(reg.items()):
            r = _rate(count, old_reg.get(label, 0), dt)
            rows.append([pid, comm, str(label), r, _num(count), r, 0.0])
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


def _lock_waits(g):
    lw = g.get("lock_waits") if isinstance(g, dict) else None
    if isinstance(lw, dict):
        return {str(k): _num(v) for k, v in lw.items()}
    return {}


def _has_probes(g):
    if not isinstance(g, dict):
        return False
    probes = g.get("probes")
    if probes is None:
        return True
    return bool(_num(probes)) if not isinstance(probes, (list, tuple, dict)) else bool(probes)


def no_probes_sentence(pid, comm, g, who=None, whose="its"):
    """The plain sentence shown for a process whose libc has no malloc USDT probes (WHO:
    instead of "PID (comm)", e.g. for every process of a system-wide view)."""
    libc_path = g.get("libc") if isinstance(g, dict) else None
    reason = g.get("reason") if isinstance(g, dict) else None
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


def glibc_view(prev, cur, interval=None):
    """Per process: arenas, heaps, sbrk, thresholds, lock waits; then one row per waiting thread."""
    dt = interval_of(prev, cur, interval)
    procs = _by_pid(cur.get("processes"))
    glibc = _by_pid(cur.get("glibc"))
    old_glibc = _by_pid((prev or {}).get("glibc"))
    rows, groups, leaders, notes = [], [], [], []
    tot = {"processes": 0, "without_probes": 0, "lock_waits_per_s": 0.0}
    for pid in sorted(glibc):
        g = glibc[pid]
        p = procs.get(pid) if isinstance(procs.get(pid), dict) else {}
        comm = str((g.get("comm") if isinstance(g, dict) else None) or p.get("comm") or "?")
        if not _has_probes(g):
            notes.append(no_probes_sentence(pid, comm, g))
            tot["without_probes"] += 1
            continue
        if g.get("reason"):
            notes.append(f"PID {pid} ({comm}): {str(g['reason']).rstrip('.')}.")
        waits = _lock_waits(g)
        old_waits = _lock_waits(old_glibc.get(pid))
        total_waits = sum(waits.values())
        w_rate = _rate(total_waits, sum(old_waits.values()), dt)
        rows.append(
            [
                pid,
                "",
                comm,
                _get(g, "arenas"),
                _get(g, "heaps"),
                _get(g, "heap_bytes"),
                _get(g, "sbrk_bytes"),
                _opt(g, "mmap_threshold"),
                _opt(g, "trim_threshold"),
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


def _probeless_libcs(cur):
    """The libcs the glibc collector looked at, when none of them had probes to attach."""
    gc = cur.get("glibc_collector")
    libcs = [i for i in (gc.get("libcs") or ()) if isinstance(i, dict)] if isinstance(gc, dict) else []
    return [] if any(i.get("attached") for i in libcs) else libcs


def _opt(d, key):
    """A number that may be unknown (None: shown blank, null in JSON)."""
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _tid_key(tid):
    try:
        return (0, int(tid))
    except (TypeError, ValueError):
        return (1, str(tid))


_BUILDERS = {
    "processes": processes_view,
    "slab": slab_view,
    "faults": faults_view,
    "glibc": glibc_view,
}


def view_name(view):
    """'processes' for 1, '1', 'processes'; raises ValueError otherwise."""
    if isinstance(view, int) or (isinstance(view, str) and view.isdigit()):
        i = int(view)
        if 1 <= i <= len(VIEWS):
            return VIEWS[i - 1]
    elif view in VIEWS:
        return view
    raise ValueError(f"unknown view {view!r} (use 1-{len(VIEWS)} or one of {', '.join(VIEWS)})")


def build(view, prev, cur, interval=None, sort=None, reverse=None):
    """The Table of VIEW (1-4 or a name) from snapshot PREV (None at start) to CUR, sorted.

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


def build_all(prev, cur, interval=None):
    return {name: build(name, prev, cur, interval) for name in VIEWS}


def _lost(cur):
    lost = cur.get("lost") or {}
    if isinstance(lost, dict):
        return {str(k): _num(v) for k, v in lost.items() if _num(v)}
    return {"events": _num(lost)} if _num(lost) else {}


# --------------------------------------------------------------------------- sorting


def _sort_value(table, row):
    v = row[table.sort]
    col = table.columns[table.sort]
    if col.numeric:
        return (0, v if isinstance(v, (int, float)) else -math.inf)
    return (1, str(v).lower())


def sort_rows(table):
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

    def group_key(g):
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

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n):
    """1536 -> '1.5 KiB'; exact below 1 KiB ('512 B')."""
    if n is None:
        return ""
    n = _num(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B" if isinstance(n, float) else f"{sign}{n} B"
    for unit in _UNITS[1:]:
        n /= 1024.0
        if n < 1024 or unit == _UNITS[-1]:
            if n < 10:
                return f"{sign}{n:.2f} {unit}"
            if n < 100:
                return f"{sign}{n:.1f} {unit}"
            return f"{sign}{n:.0f} {unit}"
    return f"{sign}{n}"  # not reached


def human_count(x):
    """A per-second rate or count: '0', '2.5', '812', '12.3k', '4.50M'."""
    if x is None:
        return ""
    x = _num(x)
    if x == 0:
        return "0"
    ax = abs(x)
    if ax < 10 and not float(x).is_integer():
        return f"{x:.1f}"
    if ax < 1000:
        return f"{x:.0f}"
    for div, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        v = x / div
        if abs(v) < 1000 or suffix == "T":
            return f"{v:.2f}{suffix}" if abs(v) < 10 else (f"{v:.1f}{suffix}" if abs(v) < 100 else f"{v:.0f}{suffix}")
    return str(x)


def format_cell(kind, value):
    if value is None or value == "":
        return ""
    if kind in ("bytes", "byterate"):
        return human_bytes(value)
    if kind == "rate":
        return human_count(value)
    if kind == "int":
        return str(int(value)) if isinstance(value, (int, float)) else str(value)
    if kind == "pct":
        return f"{_num(value):.1f}%"
    if kind == "allocator":
        return f"allocator: {value} (not traced)"
    return str(value)


def format_rows(table):
    """Rows as strings for humans (bytes as KiB/MiB/..., rates with k/M suffixes).

    In grouped tables the non-leading rows of a group leave PID/COMM blank and indent
    their label, like a tree under the process row.
    """
    out = []
    leaders = table.leaders or [True] * len(table.rows)
    for row, lead in zip(table.rows, leaders):
        cells = [format_cell(c.kind, v) for c, v in zip(table.columns, row)]
        if table.groups and not lead:
            for i, c in enumerate(table.columns):
                if c.key in ("pid", "comm"):
                    cells[i] = ""
                elif c.key in ("region", "tid"):
                    cells[i] = "  " + cells[i]
        out.append(cells)
    return out


def headers(table, mark_sort=True):
    heads = []
    for i, c in enumerate(table.columns):
        t = c.title
        if mark_sort and i == table.sort:
            t += "v" if table.reverse else "^"
        heads.append(t)
    return heads


def summary(table):
    """One line of totals for the header of the view."""
    t = table.totals
    if table.view == "processes":
        if t.get("traced", 0) or not t.get("processes"):
            text = (
                f"{t.get('processes', 0)} processes, {human_count(t.get('calls_per_s', 0))} calls/s, "
                f"{human_bytes(t.get('requested_bytes_per_s', 0))}/s requested, "
                f"{human_bytes(t.get('live_bytes', 0))} live, {human_count(t.get('faults_per_s', 0))} faults/s"
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


def text_table(table, tablefmt="simple"):
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
    lines.extend(table.notes)
    return "\n".join(line for line in lines if line != "")


def to_json(table):
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
