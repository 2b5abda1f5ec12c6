"""GlibcSource: glibc's malloc USDT probes (and, for run/summary, the traced process's page
faults, mmaps and brks), aggregated per process in BPF maps and optionally streamed as ProbeHits.

The probe sites, their argument decoding and the generated BPF code come from
pymtrace.sources.usdt; the program is bpf/glibc_usdt.bpf.c, whose constants (pseudo-probe ids,
flag bits, causes) are read from bpf/glibc_usdt.h.

GlibcSource.snapshot() (cumulative since attach, JSON-able; consumed by `pymtrace top` view 4
(pymtrace/sinks/views.py), the exporter and `pymtrace summary`) gives the snapshot keys
"glibc" ({pid: entry}), "lost" ({"glibc_events": n}) and "glibc_collector": their schema is
pymtrace.sources.snapshot's (GlibcProcess, GlibcSourceInfo).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Iterable, Mapping

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import uprobes
from pymtrace.errors import PymtraceError
from pymtrace.sources import usdt
from pymtrace.sources.base import Source, uprobe
from pymtrace.stopping import stop_deferred
from pymtrace.tracee import libc, proc

_CONSTS = usdt.header().consts
PROBE_OPEN = _CONSTS["PROBE_OPEN"]
FIRST_PSEUDO = _CONSTS["PROBE_FAULT"]  # probe ids from here on are tracepoints, not USDT sites
EV_FILE = _CONSTS["EV_FILE"]  # an mmap of a file: its descriptor is in .fd
EV_CAUSE_SHIFT, EV_CAUSE_MASK = _CONSTS["EV_CAUSE_SHIFT"], _CONSTS["EV_CAUSE_MASK"]
# pseudo-probe id -> (name, argument names); ids from bpf/glibc_usdt.h
PSEUDO_PROBES = {
    _CONSTS["PROBE_FAULT"]: ("page_fault", ("address", "ip", "error_code")),
    _CONSTS["PROBE_MMAP"]: ("mmap", ("addr", "len", "prot_flags")),
    _CONSTS["PROBE_MUNMAP"]: ("munmap", ("addr", "len")),
    _CONSTS["PROBE_BRK"]: ("brk", ("brk",)),
    PROBE_OPEN: ("open", ("fd",)),
}


# ---------------------------------------------------------------- events


class ProbeHit:
    """One decoded probe hit (or pseudo-probe from a tracepoint: page_fault, mmap, ...)."""

    __slots__ = (
        "ts",
        "pid",
        "tid",
        "comm",
        "probe",
        "probe_id",
        "site",
        "args",
        "names",
        "flags",
        "cause",
        "unreadable",
        "fd",
        "path",
    )

    def as_dict(self, wall_offset: float = 0.0) -> dict[str, Any]:
        d = {
            "time": round(self.ts / 1e9 + wall_offset, 6),
            "ts_ns": self.ts,
            "pid": self.pid,
            "tid": self.tid,
            "comm": self.comm,
            "probe": self.probe,
            "args": {n: (None if i in self.unreadable else v) for i, (n, v) in enumerate(zip(self.names, self.args))},
        }
        if self.cause:
            d["cause"] = self.cause
        if self.probe == "memory_mallopt" and self.args:
            d["param_name"] = usdt.MALLOPT_PARAMS.get(self.args[0], "unknown")
        if self.unreadable:
            d["unreadable"] = sorted(self.names[i] for i in self.unreadable if i < len(self.names))
        return d

    def format_args(self) -> str:
        out = []
        for i, (n, v) in enumerate(zip(self.names, self.args)):
            if i in self.unreadable:
                out.append(f"{n}=?")
            elif self.probe == "memory_mallopt" and n == "param":
                out.append(f"param={usdt.MALLOPT_PARAMS.get(v, v)}")
            elif n in usdt.POINTER_ARGS:
                out.append(f"{n}={v:#x}")
            else:
                out.append(f"{n}={v}")
        if self.cause:
            out.append(f"cause={self.cause}")
        return " ".join(out)


def _signed(value: int, size: int) -> int:
    bits = size * 8
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


# ---------------------------------------------------------------- source


class GlibcSource(Source):
    """Attach glibc's malloc USDT probes and aggregate per process in BPF maps.

    pids=None: system-wide, by library path, for every libc with probes mapped by a
    running process at attach() time (plus `libcs`: a libc no process maps yet must be
    named there; the program is compiled once, so libcs appearing later are not added). pids=[...]: per PID, on the libc each one maps
    (`libcs={pid: path}` overrides, e.g. for a command launched stopped at exec).
    stream=True: also deliver every event to on_event(ProbeHit) from poll().
    faults=True: also emit page faults / mmap / munmap / brk of the traced pids
    (see add_fault_pid; pymtrace run/summary).
    In pymtrace.sources.bundle.Sources it is contained: its failures are reported, not raised.
    """

    program = "glibc_usdt"
    what = "tracing glibc's malloc probes"
    contained = True  # view 4 of top: its failures must not take the other views down
    attach_order = 0

    def __init__(
        self,
        pids: Iterable[int | str] | None = None,
        libcs: Mapping[int, str | None] | Iterable[str] | None = None,
        stream: bool = False,
        on_event: Callable[[ProbeHit], None] | None = None,
        faults: bool = False,
        ringbuf_pages: int | None = None,
        track_exits: bool = False,
    ) -> None:
        super().__init__(None, track_exits)
        # PIDs as given, unchecked: one that is gone is reported ("no libc"), not raised
        self.pids = None if pids is None else [int(p) for p in pids]
        self.libc_override = libcs or {}
        self.stream = stream or on_event is not None or faults
        self.on_event = on_event
        self.faults = faults
        self.ringbuf_pages = ringbuf_pages or (4096 if faults else 256)
        self.with_probes = []
        self.sites = []
        self.site_by_id = {}
        self.warnings = []
        self.pid_libc = {}  # pid -> libc path
        self.libc_info = []  # [{"libc", "probes", "sites", "attached"}]
        self.names = {}  # probe id -> name
        self._status_cache = {}
        self._exit_new, self._exit_pending = set(), set()
        self.wall_offset = time.time() - time.monotonic()
        h = usdt.header()
        self.event_struct = h.structs["glibc_event"]
        self.stats_struct = h.structs["glibc_pid_stats"]
        self.path_event_struct = h.structs["glibc_path_event"]

    # -- attach / detach
    def _plan(self) -> list[tuple[str, list[int] | None]]:
        """[(libc path, [pid] or None)] to attach."""
        plan = {}
        if self.pids is None:
            paths = (
                list(self.libc_override.values()) if isinstance(self.libc_override, dict) else list(self.libc_override)
            )
            paths += usdt.all_libcs()
            for path in paths:
                key = libc.file_key(path)
                if key is not None and key not in plan:
                    plan[key] = (path, None)
        else:
            for pid in self.pids:
                path = self.libc_override.get(pid) if isinstance(self.libc_override, dict) else None
                if path is None:
                    path = usdt.probe_file(pid)
                self.pid_libc[pid] = path
                if path is None:
                    continue
                key = libc.file_key(path)
                if key is None:
                    continue
                entry = plan.setdefault(key, (path, []))
                entry[1].append(pid)
        return list(plan.values())

    def prepare(self) -> None:
        """Find the libcs and probe sites to attach (and generate their BPF code)."""
        super().prepare()
        plan = self._plan()
        with_probes = []
        for path, pids in plan:
            st = usdt.libc_status(path)
            self.libc_info.append(
                {
                    "libc": path,
                    "probes": st["probes"],
                    "sites": st["sites"],
                    "attached": bool(st["probes"]),
                    "pids": pids,
                    "reason": st["reason"],
                }
            )
            if st["probes"]:
                with_probes.append((path, pids))
        self.sites, warnings = usdt.build_sites([p for p, _ in with_probes])
        self.warnings.extend(warnings)
        self.site_by_id = {s.id: s for s in self.sites}
        for s in self.sites:
            self.names[s.probe_id] = s.name
        self.with_probes = with_probes

    def part(self) -> bpfload.Part | None:
        """The program with one generated function per probe site, or None when there is
        nothing to compile (no probes and no faults: a source that only reports why)."""
        if not (self.sites or self.faults):
            return None
        defines = {"RINGBUF_PAGES": self.ringbuf_pages}
        if self.faults:
            defines["WITH_FAULTS"] = 1
        if not self.stream:
            defines["NO_STREAM"] = 1  # aggregates only: nothing fills the ring buffer
        return bpfload.Part(self.program, defines, usdt.generate(self.sites))

    def _attach(self) -> None:
        if self.stream:
            self.bpf["events"].open_ring_buffer(self._on_raw)
        if not self.sites:
            return
        with_probes = self.with_probes
        sites_by_libc = {}
        for s in self.sites:
            sites_by_libc.setdefault(s.libc, []).append(s)
        for path, pids in with_probes:
            probes = [
                uprobe(path, s.probe.address, s.fn, pid, what=s.probe.name)
                for s in sites_by_libc.get(path, [])
                for pid in (pids if pids is not None else [-1])
            ]
            try:
                uprobes.attach(self.bpf, probes)
            except Exception as exc:  # BCC raises bare Exception for a failed attach; links OSError
                raise PymtraceError(f"cannot attach uprobe to a malloc probe of {path}: {exc}") from None

    def close(self) -> None:
        if self.bpf is not None:
            self.poll()  # the events still in the ring buffer
        super().close()

    # -- faults
    def add_fault_pid(self, pid: int) -> None:
        if self.bpf is not None and self.faults:
            self.bpf["fault_pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    # -- events
    def _on_raw(self, ctx: Any, data: Any, size: int) -> int:
        raw = ctypes.cast(data, ctypes.POINTER(self.event_struct)).contents
        ev = ProbeHit()
        ev.ts = raw.ts
        ev.pid = raw.pid
        ev.tid = raw.tid
        ev.comm = raw.comm.decode("utf-8", "replace")
        self.comms.names[ev.pid] = ev.comm  # the name at its last event
        ev.probe_id = raw.probe
        ev.site = raw.site
        ev.flags = raw.flags
        ev.fd = raw.fd
        ev.path = None
        ev.cause = usdt.CAUSES.get((raw.flags >> EV_CAUSE_SHIFT) & EV_CAUSE_MASK)
        site = self.site_by_id.get(raw.site) if raw.probe < FIRST_PSEUDO else None
        if site is not None:
            ev.probe = site.name
            n = len(site.probe.arg_specs[: usdt.MAX_ARGS])
            ev.names = usdt.arg_names(site.name, n)
            args = []
            for i in range(n):
                spec = site.specs[i]
                v = raw.args[i]
                args.append(_signed(v, spec.size) if spec is not None and spec.signed else v)
            ev.args = tuple(args)
            ev.unreadable = frozenset(i for i in range(n) if raw.flags & (usdt.EV_ARG_UNREADABLE << i))
        else:
            ev.probe, ev.names = PSEUDO_PROBES.get(raw.probe, (f"probe{raw.probe}", ()))
            ev.args = tuple(raw.args[: len(ev.names)])
            ev.unreadable = frozenset()
            if raw.probe == PROBE_OPEN:
                pe = ctypes.cast(data, ctypes.POINTER(self.path_event_struct)).contents
                ev.path = pe.path.decode("utf-8", "replace")
        if self.on_event is not None:
            self.on_event(ev)
        return 0

    def poll(self) -> None:
        """Deliver every event waiting in the ring buffer (stream mode)."""
        if self.bpf is not None and self.stream:
            with stop_deferred():  # raised inside BCC's ctypes callback, a stop would be swallowed
                self.bpf.ring_buffer_consume()

    def lost(self) -> int:
        if self.bpf is None:
            return 0
        return int(sum(self.bpf["lost"].getvalue(ctypes.c_int(0))))

    def map_full(self) -> dict[str, int]:
        if self.bpf is None:
            return {}
        names = ("stats", "heaps", "threads", "arenas")
        vals = {}
        for i, name in enumerate(names):
            n = int(sum(self.bpf["map_full"].getvalue(ctypes.c_int(i))))
            if n:
                vals[name] = n
        return vals

    # -- state
    def libc_of(self, pid: int) -> str | None:
        if pid in self.pid_libc:
            return self.pid_libc[pid]
        try:
            path = libc.process_libc(pid)
        except (PymtraceError, OSError):
            path = None
        self.pid_libc[pid] = path
        return path

    def _status(self, path: str | None) -> dict[str, Any]:
        if path not in self._status_cache:
            self._status_cache[path] = usdt.libc_status(path)
        return self._status_cache[path]

    def forget(self, pid: int) -> None:
        """Drop every BPF map entry of PID (e.g. when it has exited); it is no longer reported."""
        pid = int(pid)
        if self.pids is not None and pid in self.pids:
            self.pids.remove(pid)
        if self.bpf is None:
            return
        try:
            del self.bpf["stats"][ctypes.c_uint32(pid)]
        except KeyError:
            pass
        for name in ("threads", "arenas", "heaps"):
            table = self.bpf[name]
            for k in [k for k in table.keys() if k.pid == pid]:
                try:
                    del table[k]
                except KeyError:
                    pass
        self.pid_libc.pop(pid, None)
        self.comms.forget(pid)

    def exited(self, pid: int) -> None:
        """PID has exited (process-events connector): it is reported once more (alive False,
        final values) by the next snapshot() and forgotten at the one after. Thread-safe:
        map entries are only deleted from snapshot()'s thread."""
        self._exit_new.add(int(pid))

    def prune(self) -> None:
        """Forget every process that no longer exists."""
        if self.bpf is None:
            return
        for k in list(self.bpf["stats"].keys()):
            if not proc.exists(k.value):
                self.forget(k.value)

    def snapshot(self, pids: Iterable[int | str] | None = None) -> dict[str, Any]:
        """The cumulative state (see the module docstring). PIDS: also report these."""
        for pid in self._exit_pending:
            self.forget(pid)
        self._exit_pending, self._exit_new = self._exit_new, set()
        self.poll()
        out = {}
        stats = {}
        threads, arenas, heaps = {}, {}, {}
        if self.bpf is not None and self.sites:
            for k, v in self.bpf["stats"].items():
                stats[k.value] = v
            for k, v in self.bpf["threads"].items():
                threads.setdefault(k.pid, {})[k.tid] = v
            for k, v in self.bpf["arenas"].items():
                arenas.setdefault(k.pid, {})[k.addr] = v
            for k, v in self.bpf["heaps"].items():
                heaps.setdefault(k.pid, {})[k.addr] = v.value
        wanted = set(stats)
        wanted.update(self.pids or [])
        wanted.update(int(p) for p in (pids or []))
        for pid in sorted(wanted):
            out[pid] = self._pid_snapshot(
                pid, stats.get(pid), threads.get(pid, {}), arenas.get(pid, {}), heaps.get(pid, {})
            )
        lost = self.lost()
        return {
            "glibc": out,
            "lost": {"glibc_events": lost},
            "glibc_collector": {
                "lost_events": lost,
                "map_full": self.map_full(),
                "libcs": [{k: v for k, v in i.items() if k != "pids"} for i in self.libc_info],
                "warnings": list(self.warnings),
            },
        }

    def _pid_snapshot(
        self, pid: int, s: Any, threads: Mapping[int, Any], arenas: Mapping[int, Any], heaps: Mapping[int, int]
    ) -> dict[str, Any]:
        alive = proc.exists(pid)
        comm = self.comms.get(pid, refresh=alive)  # exited: the name last seen
        path = self.libc_of(pid) if (alive or pid in self.pid_libc) else None
        if path is None and s is not None and s.last_site in self.site_by_id:
            path = self.site_by_id[s.last_site].libc  # exited: the libc its events came from
            self.pid_libc[pid] = path
        st = (
            self._status(path)
            if (path is not None or alive)
            else {"libc": None, "probes": 0, "reason": "process exited before its libc was seen"}
        )
        g = {
            "pid": pid,
            "comm": comm,
            "alive": alive,
            "libc": st["libc"],
            "probes": st["probes"],
            "reason": st["reason"],
        }
        if s is None and st["probes"] and path is not None and not self._attached_to(path):
            g["reason"] = f"libc {path} was not mapped by any process when probes were attached"
        if not st["probes"]:
            return g
        s = s if s is not None else self.stats_struct()
        g.update(
            {
                "events": s.events,
                "arenas": 1 + s.arenas_new,
                "arenas_created": s.arenas_new,
                "arena_reuse": s.arena_reuse,
                "arena_reuse_free_list": s.arena_reuse_free_list,
                "arena_lock_waits": s.arena_reuse_wait,
                "arena_list": [
                    {"arena": f"{a:#x}", "creator_tid": v.creator_tid or None, "attaches": v.attaches, "waits": v.waits}
                    for a, v in sorted(arenas.items())
                ],
                "heaps": len(heaps),
                "heap_bytes": s.heap_bytes,
                "heap_bytes_max": s.heap_bytes_max,
                "heaps_created": s.heaps_new,
                "heaps_freed": s.heaps_freed,
                "heap_grow": s.heap_more,
                "heap_shrink": s.heap_less,
                "heap_list": [{"heap": f"{a:#x}", "size": n} for a, n in sorted(heaps.items())],
                "sbrk_bytes": s.sbrk_more_bytes,
                "sbrk_grow_count": s.sbrk_more_count,
                "sbrk_trimmed_bytes": s.sbrk_less_bytes,
                "sbrk_trim_count": s.sbrk_less_count,
                "sbrk_failed": s.sbrk_failed,
                "dyn_threshold_changes": s.dyn_threshold_changes,
                "mallopt_calls": s.mallopt_calls,
                "tcache_double_free_scans": s.tcache_double_free,
                "retries": {
                    "malloc": s.malloc_retry,
                    "realloc": s.realloc_retry,
                    "calloc": s.calloc_retry,
                    "memalign": s.memalign_retry,
                    "arena": s.arena_retry,
                },
                "lock_waits": {tid: t.waits for tid, t in sorted(threads.items()) if t.waits},
                "threads": {
                    tid: {
                        "lock_waits": t.waits,
                        "arena": f"{t.arena:#x}" if t.arena else None,
                        "arena_switches": t.arena_switches,
                    }
                    for tid, t in sorted(threads.items())
                },
            }
        )
        params = {}
        live = usdt.read_params(pid, path) if alive and path else {}
        for i, name in enumerate(usdt.PARAM_NAMES):
            if s.params_known >> i & 1:
                params[name] = {
                    "value": s.params[i],
                    "cause": usdt.CAUSES.get(s.params_cause[i]) or "initial",
                    "source": "probe",
                }
            elif name in live:
                params[name] = {"value": live[name], "cause": "initial", "source": "memory"}
        for name in ("mmap_threshold", "trim_threshold"):
            if name in live and name in params:
                params[name]["value"] = live[name]
                params[name]["source"] = "memory"
        g["params"] = params
        g["mmap_threshold"] = params.get("mmap_threshold", {}).get("value")
        g["trim_threshold"] = params.get("trim_threshold", {}).get("value")
        return g

    def _attached_to(self, path: str) -> bool:
        key = libc.file_key(path)
        return any(i["attached"] and libc.file_key(i["libc"]) == key for i in self.libc_info)
