"""The source lifecycle (Source) and the helpers every source shares: BPF programs in,
JSON-able snapshots out. The bundle top and the exporter run is pymtrace.sources.bundle.Sources.

Stable API (used by pymtrace.commands.top, pymtrace.sinks.tui via top, and the Prometheus exporter):

    from pymtrace.sources.bundle import Sources
    from pymtrace.sources.malloc import MallocSource  # likewise slab.SlabSource, faults.FaultSource

    c = MallocSource(pids=None)      # None: every process; or a list of PIDs
    c.attach()                          # compile, load, attach (raises PymtraceError)
    snap = c.snapshot()                 # cheap enough to call every second
    c.close()                           # detach everything; safe to call twice

    # or all at once (one process-exit watcher shared by all sources):
    with Sources(pids=[1234], malloc=True, slab=True, faults=True, glibc=True) as cs:
        snap = cs.snapshot()

Every source takes pids=None|[...] and track_exits=True (start its own cn_proc watcher to
drop the state of exited processes; the bundle passes False and feeds them exits itself via
exited(tgid)). Attributes read by attach(), settable before it: MallocSource.max_procs,
FaultSource.max_procs / .max_granules / .regions (False: no per-region map, no
"fault_regions"), SlabSource.max_caches. Sources(...).sources is {"malloc", "faults",
"slab", "glibc"} -> source, for such settings. Snapshots are CUMULATIVE since attach, plus gauges; consumers compute rates from
two snapshots (pymtrace.sinks.views does). PIDs are int keys here; they become strings after
json.dumps. The snapshot's schema, typed, and the merge of the sources' snapshots into
one: pymtrace.sources.snapshot.

Exited processes: a process that exits appears once more with "exited": True, then its
BPF state is deleted. Every map is bounded and LRU (BPF_TABLE "lru_percpu_hash" /
"lru_hash"), so 10,000 short-lived processes cannot grow memory without limit:
MallocSource 8192 processes ("ms_stats"), FaultSource 16384 processes ("pf_totals")
and 65536 address granules ("pf_regions"), SlabSource 2048 cache names ("slab_stats").
When a map is full, a new key evicts the least recently used one instead of being dropped:
an evicted process disappears from the snapshots or, at its next event, comes back with
counters restarted from 0 ("evicted" counts both cases, as seen between two snapshots;
pymtrace.sinks.prometheus.Aggregator keeps its counters monotonic across them). Evicted granules
lose their per-region counts; the per-process totals are unaffected.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, Sequence

from pymtrace.bpf import kfeatures, structs, uprobes
from pymtrace.bpf import load as bpfload
from pymtrace.bpf import stats as bpfstats
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.tracee import elf, proc

if TYPE_CHECKING:
    from pymtrace.tracee.procevents import ProcEvent, ProcEvents


def lost_names(program: str, prefix: str) -> dict[int, str]:
    """{index: name} of a program's lost-event counters (#define PREFIX_LOST_<NAME> i)."""
    consts = structs.header(program).consts
    return {
        v: k[len(prefix) + len("_LOST_") :].lower()
        for k, v in consts.items()
        if k.startswith(prefix + "_LOST_") and not k.endswith("_N")
    }


def skipped_runs(bpf: Any, functions: Iterable[str]) -> int | None:
    """Events the kernel dropped without running FUNCTIONS (BPF programs of BCC module BPF) on
    them, summed (pymtrace.bpf.stats.recursion_misses), or None where the kernel does not
    count them. Reported as a lost cause: the counts lack those events. A (non-raw) tracepoint
    program's skips are counted only where kfeatures.tracepoint_misses_counted(): elsewhere its
    recursion_misses stays 0 whatever was skipped, which is not reported as none skipped."""
    total = None
    for name in functions:
        if name.startswith("tracepoint__") and not kfeatures.tracepoint_misses_counted():
            continue
        fn = bpf.funcs.get(name.encode()) if bpf is not None else None
        n = bpfstats.recursion_misses(fn.fd) if fn is not None else None
        if n is not None:
            total = (total or 0) + n
    return total


def check_pids(pids: Iterable[int | str] | None) -> list[int] | None:
    if pids is None:
        return None
    out = []
    for pid in pids:
        pid = int(pid)
        if not proc.exists(pid):
            raise ProcessGone(pid)
        out.append(pid)
    return sorted(set(out))


def struct_fields(program: str, name: str) -> list[str]:
    return [f for f, _ in structs.header(program).structs[name]._fields_]


def to_dict(value: Any, fields: Iterable[str]) -> dict[str, Any]:
    out = {}
    for f in fields:
        v = getattr(value, f)
        out[f] = list(v) if hasattr(v, "__len__") and not isinstance(v, (bytes, str)) else v
    return out


_COMM_FIELDS = ("comm", "comm_ns")


def sum_percpu(values: Iterable[Any], fields: Iterable[str]) -> dict[str, Any]:
    """Sum a per-CPU list of ctypes structs into one dict (array fields elementwise; the
    comm/comm_ns fields are left out: see bpf_comm)."""
    fields = [f for f in fields if f not in _COMM_FIELDS]
    total = None
    for v in values:
        d = to_dict(v, fields)
        if total is None:
            total = d
            continue
        for f, x in d.items():
            if isinstance(x, list):
                total[f] = [a + b for a, b in zip(total[f], x)]
            else:
                total[f] += x
    return total or {}


def bpf_comm(values: Iterable[Any]) -> str | None:
    """The process name the BPF program recorded in a per-CPU entry (the slot written last:
    at the entry's creation or at the process's exec), or None."""
    best = max(values, key=lambda v: v.comm_ns, default=None)
    if best is None or not best.comm_ns:
        return None
    name = bytes(best.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
    return name or None


def percpu_items(table: Any) -> list[tuple[Any, list[Any]]]:
    """[(key, [per-CPU values])] of a BCC per-CPU table, tolerant of concurrent deletes."""
    out = []
    for k in list(table.keys()):
        try:
            out.append((k, table.getvalue(k)))
        except KeyError:
            continue
    return out


def lost_counts(table: Any, names: Mapping[int, str]) -> dict[str, int]:
    out = {}
    for idx, name in names.items():
        try:
            vals = table.getvalue(table.Key(idx))
            out[name] = int(sum(vals))
        except KeyError:  # BCC's getvalue of a missing index
            continue
    return out


def uprobe(path: str, address: int, fn_name: str, pid: int = -1, ret: bool = False, what: str = "") -> uprobes.Probe:
    """A probe for bpf.uprobes.attach at ELF virtual ADDRESS of PATH (its file offset read
    from PATH's program headers): FN_NAME's uprobe, or uretprobe with RET; PID -1: all."""
    return uprobes.Probe(path, address, elf.code_offset(path, address), fn_name, pid, ret, what)


def attach_plan(
    bpf: Any,
    path: str,
    pid: int,
    plan: Sequence,
    kinds: Collection[str] = ("entry", "return"),
    handles: list | None = None,
) -> list:
    """Attach the probes of KINDS in PLAN, [(function, [(kind, offset from the function's
    symbol, BCC program)])], in PATH for PID (-1: every process) through bpf.uprobes.
    Returns [(path, function, offset, kind, pid)] attached; raises ProcessGone when PID
    went away meanwhile, else PymtraceError naming the file and the cause. HANDLES: a list
    that gets uprobes.attach()'s Attached (for uprobes.release())."""
    probes, attached = [], []
    try:
        for function, plan_probes in plan:
            address = elf.symbol(path, function).address
            for kind, off, fn_name in plan_probes:
                if kind in kinds:  # a return probe with an offset: at a moved entry site, one breakpoint for both
                    probes.append(uprobe(path, address + off, fn_name, pid, kind != "entry", function))
                    attached.append((path, function, off, kind, pid))
        added = uprobes.attach(bpf, probes)
        if handles is not None:
            handles.append(added)
    except Exception as exc:  # BCC's attach raises plain Exception, a link OSError, ELF reading PymtraceError
        if pid != -1 and not proc.alive(pid):
            raise ProcessGone(pid) from None
        raise PymtraceError(f"cannot attach uprobes to {path}: {exc}") from None
    return attached


class Comms:
    """PID -> comm, remembered so an exited process keeps its name: /proc/PID/comm while the
    process lives (its main thread's name), else the name the BPF program recorded (BPF)."""

    def __init__(self) -> None:
        self.names = {}

    def get(self, pid: int, refresh: bool = False, bpf: str | None = None) -> str:
        if refresh or pid not in self.names or (self.names[pid] == "?" and bpf):
            name = proc.comm(pid, missing="?")
            if name == "?" and bpf:
                name = bpf  # exited before we could read /proc: the name BPF recorded
            if name != "?" or pid not in self.names:
                self.names[pid] = name
        return self.names[pid]

    def forget(self, pid: int) -> None:
        self.names.pop(pid, None)


class Evictions:
    """Entries of a per-process LRU map that the kernel evicted, as user space sees them: a
    process of the previous snapshot, not exited, whose entry is gone or whose cumulative
    count went down (evicted, then re-created by its next event)."""

    def __init__(self) -> None:
        self.prev = {}  # pid -> cumulative activity at the previous snapshot
        self.count = 0

    def update(self, activity: Mapping[int, int], gone: Collection[int]) -> None:
        """ACTIVITY: {pid: cumulative count} of this snapshot; GONE: pids reported exited now."""
        for pid, before in self.prev.items():
            now = activity.get(pid)
            if now is None:
                if proc.exists(pid):
                    self.count += 1
            elif now < before:
                self.count += 1
        self.prev = {pid: n for pid, n in activity.items() if pid not in gone}

    def info(self, entries: int, max_entries: int) -> dict[str, int]:
        return {"entries": entries, "max_entries": max_entries, "evicted": self.count}


def watch_exits(on_event: Callable[[ProcEvent], None]) -> ProcEvents:
    """A started cn_proc watcher calling ON_EVENT with exit and exec events."""
    from pymtrace.tracee.procevents import ProcEvents

    return ProcEvents(on_event=on_event, kinds=("exit", "exec")).start()


def process_exit(ev: ProcEvent) -> bool:
    """EV is the exit of a process (its thread-group leader), not of one of its threads."""
    return ev.kind == "exit" and ev.pid == ev.tgid


class Source:
    """One BPF program's source, and the lifecycle every source follows:

    prepare() (find what to attach to, before compiling) -> plan() (work that can overlap the
    compile) -> part() (the bpfload.Part to compile; None: nothing to compile, the source
    only reports why) -> attach(bpf) (load or share the module, then _attach()) ->
    snapshot() (cumulative counters) ... -> close(). exited(tgid) and on_process_event(ev)
    feed it process exits. Sources runs several as one BCC module.

    Class attributes say how Sources treats a source's failures: `required` (its
    failures end the bundle: what top is for), else prepare/compile failures drop it with
    the reason in snapshot["errors"]; `contained` (every failure, at any step and of any
    kind, is recorded there and drops it: its bugs must not take top down)."""

    program = None  # bpf/<program>.bpf.c
    what = None  # what the program does, for errors ("tracing ...")
    required = False
    contained = False
    attach_order = 1  # Sources attaches lower first (malloc's per-call uprobes last)

    def __init__(self, pids: Iterable[int | str] | None = None, track_exits: bool = True) -> None:
        self.pids = check_pids(pids)
        self.track_exits = track_exits
        self.bpf = None
        self.owns_bpf = False  # False: the module is shared (Sources compiled it) and closed by its owner
        self.prepared = False
        self.start = None
        self._events = None
        self._exited = set()  # tgids seen exiting, reported once more then dropped
        self._lock = threading.Lock()
        self.comms = Comms()

    # -- lifecycle
    def part(self) -> bpfload.Part | None:
        """The bpfload.Part this source's program is compiled from (read by attach()),
        or None when there is nothing to compile."""
        return bpfload.Part(self.program, self._defines())

    def _defines(self) -> dict[str, Any]:
        return {}

    def fallback(self, reason: str) -> bool:
        """This kernel rejected the program (REASON): switch to a less demanding way of
        collecting, which part() then gives; False when there is none."""
        return False

    def prepare(self) -> None:
        """Before the compile: find what to attach to (errors before seconds of compiling)."""
        self.prepared = True

    def plan(self) -> None:
        """Work that can run while the compile does (Sources runs it in parallel)."""

    def attach(self, bpf: Any = None) -> Source:
        """Compile, load, attach. BPF: a module compiled with part() among others
        (Sources: one compile for all), left for its owner to close; None: compile here."""
        self.start = time.monotonic()
        for pid in self.pids or ():
            self.comms.get(pid)  # remembered in case it exits before its first snapshot
        try:
            if not self.prepared:
                self.prepare()
                self.plan()
            part = self.part()
            if part is None:
                return self  # nothing to attach: a source that only reports why
            if bpf is None:
                bpf = bpfload.load_parts([part], what=self.what)
                self.owns_bpf = True
            self.bpf = bpf
            self._attach()
            if self.track_exits:
                self._events = watch_exits(self.on_process_event)
        except BaseException:
            self.close()
            raise
        return self

    def _attach(self) -> None:
        """Attach this source's probes to self.bpf (tracepoints: BCC did at load)."""

    def on_process_event(self, ev: ProcEvent) -> None:
        """A cn_proc event (pymtrace.tracee.procevents): exits and execs."""
        if process_exit(ev):
            self.exited(ev.tgid)
        elif ev.kind == "exec":
            self.comms.forget(ev.tgid)

    def exited(self, tgid: int) -> None:
        """Tell the source TGID exited: reported once more (exited=True), then dropped."""
        with self._lock:
            self._exited.add(tgid)

    def _take_exited(self, present: Iterable[int] = ()) -> set[int]:
        """TGIDs to report as exited now: exit events seen, plus PIDS in PRESENT that no
        longer exist (events lost in a fork storm, or exits before the watcher started)."""
        with self._lock:
            gone, self._exited = self._exited, set()
        gone |= {pid for pid in present if not proc.exists(pid)}
        return gone

    def snapshot(self) -> dict[str, Any]:
        """The cumulative state since attach (schema: this module's docstring)."""
        raise NotImplementedError

    def _per_process(self, table: Any) -> tuple[list[tuple[int, dict[str, Any], str]], set[int], int]:
        """Read a per-CPU map keyed by pid: ([(pid, counters summed over CPUs, comm)], the
        pids to report as exited now, the number of entries)."""
        items = percpu_items(table)
        gone = self._take_exited(int(k.value) for k, _ in items)
        rows = []
        for key, values in items:
            pid = int(key.value)
            rows.append((pid, sum_percpu(values, self.fields), self.comms.get(pid, bpf=bpf_comm(values))))
        return rows, gone, len(items)

    def close(self) -> None:
        if self._events is not None:
            self._events.stop()
            self._events = None
        if self.owns_bpf:
            uprobes.detach(self.bpf)
        self.bpf = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _delete(self, table: Any, key: Any) -> None:
        try:
            del table[key]
        except KeyError:
            pass
