"""MallocSource: per-process malloc-API counters from uprobes on each process's allocator.

Probe placement (MallocSource): uprobes on the process's libc (from /proc/PID/maps;
system-wide: the system libc plus every other libc mapped by a running process), each
entry probe at the first instruction the kernel emulates (pymtrace.tracee.probesite; glibc 2.36's
free goes at +9 `push %rbp` instead of +0 `test %rdi,%rdi`, which is single-stepped at ~5x
the cost, plus the early-exit `ret` that free(NULL) takes). Return probes for malloc,
calloc, realloc and the memalign family. Nested internal calls (realloc -> malloc/free,
memalign -> malloc) are not counted (see bpf/malloc_stats.bpf.c).

A process whose malloc resolves elsewhere (jemalloc, tcmalloc, mimalloc preloaded or
linked, a malloc defined in the executable: pymtrace.tracee.libc.allocator) is counted on
that file through the tables of pymtrace.tracee.allocators (ms_f_* programs), placed by
the same rules; system-wide, every mapped non-libc file that defines malloc is probed.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

from pymtrace.bpf import structs
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources import heapefficiency
from pymtrace.sources.base import (
    Evictions,
    Source,
    attach_plan,
    lost_counts,
    lost_names,
    struct_fields,
    sum_percpu,
)
from pymtrace.sources.snapshot import call_names
from pymtrace.tracee import allocators, libc, mallocapi, probesite, proc

# function -> (entry program, return program or None), from the one malloc-API table
# (target/mallocapi.py): an outer call's return is ms_outer_return (its inner malloc/free
# calls are not counted again). memalign and aligned_alloc are one function in glibc 2.36
# (attached once) and two in 2.41; both are counted as memalign.
MALLOC_PROBES = tuple(
    (f.name, f"ms_{f.call}_entry", ("ms_outer_return" if f.outer else f"ms_{f.call}_return") if f.returns else None)
    for f in mallocapi.FUNCTIONS
)


class Uncounted(PymtraceError):
    """A watched process whose malloc calls cannot be counted (no allocator top can probe)."""


def probe_plan(path: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """top's uprobes on the libc at PATH: [(function, [(kind, offset, bpf_function), ...])].

    Entry probes go where pymtrace.tracee.probesite finds an emulated instruction (plus the
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


class MallocSource(Source):
    """Per-process malloc-API counters from uprobes on each process's libc."""

    program = "malloc_stats"
    what = "tracing malloc calls"
    required = True  # what top is for: not a view to leave empty
    attach_order = 2  # last: its per-call uprobes slow down everything after them

    def __init__(
        self,
        pids: Iterable[int | str] | None = None,
        track_exits: bool = True,
        max_procs: int = 8192,
    ) -> None:
        super().__init__(pids, track_exits)
        self.max_procs = max_procs
        self.attached = []  # (path, function, offset, kind, pid)
        self.libcs = {}  # libc (or other allocator's file) path -> [pids] (or [-1] for every process)
        self.families = {}  # path -> "glibc" or a pymtrace.tracee.allocators.FAMILIES key
        self.cxx = {}  # file where C++ operator new/delete resolve -> [pids] (or [-1])
        self.cxx_plans = {}  # its probes (allocators.CXX)
        self.foreign_programs = set()  # the other allocators' ms_f_* programs the files need
        self.skipped = []  # system-wide: (path, {pid, ...}, reason) of libc files not traced
        self._users = {}  # system-wide: libc path -> the processes mapping it
        self.fields = struct_fields(self.program, "ms_stats")
        self.call_names = call_names()
        self.evictions = Evictions()
        self.rss_anon_base = {}  # pid -> RssAnon bytes when counting began (heap efficiency)
        self.counted = set()  # pids that have had an ms_stats entry (an evicted one stays out)

    def _targets(self):
        """{path: [pid, ...] or [-1]}, one path per distinct file (dev, inode); self.families
        says which allocator family each path is probed as ("glibc": the libc's programs)."""
        targets = {}
        self.families = {}
        self.cxx = {}
        if self.pids is not None:
            uncounted = []
            for pid in self.pids:
                try:
                    path, family = self._resolve(pid)
                except Uncounted as exc:
                    uncounted.append(exc)  # named in its row (AllocatorCache.annotate)
                    continue
                targets.setdefault(path, []).append(pid)
                self.families[path] = family
                cxx = libc.cxx_runtime(pid)
                if cxx is not None:
                    self.cxx.setdefault(cxx, []).append(pid)
            if not targets and uncounted:
                raise uncounted[0]
            return targets
        self._users = {}
        maps_seen = {}
        for path, users in libc.distinct_libcs(self.skipped, maps_seen):
            targets[path] = [-1]  # decoded by plan(), while the programs compile
            self._users[path] = users
            self.families[path] = "glibc"
        if not targets:
            raise PymtraceError("found no libc to attach to")
        # Every other mapped file defining malloc, from the same maps (~5 ms for ~100
        # processes): before the compile, which includes the ms_f_* programs only if one
        # is mapped. A file first mapped after this (a process started later on an
        # allocator no process had loaded) is not probed: docs/top.md "Other allocators".
        for path, (name, users) in libc.distinct_allocators(maps_seen).items():
            targets[path] = [-1]
            self._users[path] = users
            self.families[path] = allocators.family_of(name)
        for path, users in libc.distinct_cxx_runtimes(maps_seen).items():  # C++'s operator new
            self.cxx[path] = [-1]
            self._users.setdefault(path, users)
        return targets

    @staticmethod
    def _resolve(pid: int) -> tuple[str, str]:
        """(file, family) where PID's malloc calls go (-p): its allocator when top counts it,
        else its libc; Uncounted when there is neither (a static binary)."""
        found = libc.allocator(pid)
        if found is not None and found.family not in (None, "glibc"):
            return found.path, allocators.family_of(found.name)
        path = libc.process_libc(pid)  # a sanitizer's process: its libc, as before (row named)
        if path is None:
            raise Uncounted(f"process {pid} maps no libc (static binary?): cannot trace its malloc calls")
        return path, "glibc"

    def _defines(self):
        # only the programs prepare()'s files need: the libc's, the other allocators' (of
        # those, the argument layouts the files use), C++'s operator new/delete's
        families = set(self.families.values())
        return {
            "MS_MAX_PROCS": self.max_procs,
            "MS_GLIBC": int("glibc" in families),
            "MS_FOREIGN": int(bool(families - {"glibc"})),
            "MS_CXX": int(bool(self.cxx)),
            "MS_F_SELECT": 1,
            # one return probe per process on a file: a kernel that runs each of them at every
            # return of every such process needs the entry's mark (bpf/malloc_stats.bpf.c)
            "MS_RET_ONCE": int(any(len(pids) > 1 for pids in (*self.libcs.values(), *self.cxx.values()))),
            **{f"MS_WANT_{program}": 1 for program in sorted(self.foreign_programs)},
        }

    def prepare(self) -> None:
        self.libcs = self._targets()
        self._select_programs()
        super().prepare()

    def _select_programs(self) -> None:
        """The ms_f_* programs the other allocators' files need (allocators.programs:
        symbols, PLT stubs and free's code, ~0.02 s a file; the probe sites are decoded by
        plan(), beside the compile). System-wide, a file that cannot be read is left out
        as plan() leaves it out. C++'s: exactly for a file whose symbols that just read (an
        allocator replacing operator new: tcmalloc's and mimalloc's delete is their free),
        else every variant (libstdc++ defines each; its symbol table is read beside the
        compile, ~0.04 s with pyelftools' import, for no program saved)."""
        self.foreign_programs = set()
        for path in [p for p, family in self.families.items() if family != "glibc"]:
            try:
                self.foreign_programs |= allocators.programs(path, self.families[path])
            except Exception as exc:  # whatever a malformed file raises: recorded, shown as a note
                self._leave_out(path, exc)
        for path in self.cxx:
            if self.families.get(path, "glibc") == "glibc":
                self.foreign_programs |= allocators.CXX_PROGRAMS
                continue
            try:
                self.foreign_programs |= allocators.programs(path, allocators.CXX_FAMILY)
            except PymtraceError:  # no operator new after all: plan() leaves it out, said
                self.foreign_programs |= allocators.CXX_PROGRAMS

    def _leave_out(self, path: str, exc: Exception) -> None:
        """A file that cannot be decoded: with -p (a traced process's allocator) the error,
        system-wide left out with the reason in self.skipped (only its processes untraced)."""
        if self.pids is not None:
            raise exc
        self.skipped.append((path, self._users[path], str(exc)))
        del self.libcs[path]
        self.families.pop(path, None)

    def plan(self) -> None:
        """Decode each libc's allocator functions (~0.02-0.1 s a file), run while the programs
        compile (the compile does not depend on it). System-wide, a file that cannot be
        decoded (any user can map one named libc.so.6) is left out with the reason in
        self.skipped, and only the processes mapping it go untraced."""
        self.plans = {}
        for path in list(self.libcs):
            try:
                family = self.families.get(path, "glibc")
                if family == "glibc":
                    self.plans[path] = probe_plan(path)
                else:
                    self.plans[path] = [
                        (function, [(p.kind, p.offset, p.program) for p in probes])
                        for function, probes in allocators.probe_plan(path, family)
                    ]
            except Exception as exc:  # whatever a malformed file raises: recorded, shown as a note
                self._leave_out(path, exc)
        if not self.libcs:
            raise PymtraceError("found no libc to attach to")
        self.cxx_plans = {}
        for path in list(self.cxx):
            try:
                self.cxx_plans[path] = [
                    (function, [(p.kind, p.offset, p.program) for p in probes])
                    for function, probes in allocators.probe_plan(path, allocators.CXX_FAMILY)
                ]
            except Exception as exc:  # whatever a malformed file raises: C++ calls left out, said
                self.skipped.append((path, set(self._users.get(path, self.cxx[path])), str(exc)))
                del self.cxx[path]

    def _sites(self) -> Iterator[tuple[dict, str, int, list]]:
        """(its table, path, pid, probe plan) of each attach: every libc's and C++ library's
        plan for each of its processes (a path dropped from its table meanwhile: no more)."""
        for table, plans in ((self.libcs, self.plans), (self.cxx, self.cxx_plans)):
            for path, pids in list(table.items()):
                for pid in pids:
                    if path not in table:
                        break
                    yield table, path, pid, plans[path]

    def _attach(self) -> None:
        self.bpf.attach_tracepoint(tp=b"sched:sched_process_exec", fn_name=b"ms_exec")
        for table, path, pid, plan in self._sites():
            try:
                self._attach_libc(path, pid, plan)
            except ProcessGone:
                raise
            except PymtraceError as exc:
                if self.pids is not None:  # -p: the process asked for is not traced
                    raise
                # System-wide: a file the kernel refuses (e.g. a place another tool holds
                # with its own reference counter) leaves only its processes untraced, said
                # in the note; none of its probes stays (uprobes.attach)
                self.skipped.append((path, set(self._users.get(path, ())), str(exc)))
                del table[path]
        if not self.libcs:
            raise PymtraceError("could not attach to any libc: " + libc.skipped_note(self.skipped))
        # live bytes count from now: their RSS counterpart is the growth of RssAnon from now
        # (a process absent here starts after attach: from 0); ~17 us a process
        for pid in [int(p) for p in self.pids] if self.pids is not None else libc.pids():
            mem = proc.rss(pid)
            if mem is not None:
                self.rss_anon_base[pid] = mem[1]

    def _attach_libc(self, path: str, pid: int, plan: list) -> None:
        self.attached += attach_plan(self.bpf, path, pid, plan)

    def _forget_blocks(self, pids: list[int]) -> None:
        """Delete the ms_fblocks entries (other allocators' live blocks) of exited PIDS: a
        later process with the same PID must not find them (one pass over the table)."""
        if not pids:
            return
        table = self.bpf[b"ms_fblocks"]
        wanted = set(pids)
        for key in [k for k in table.keys() if k.tgid in wanted]:
            try:
                del table[key]
            except KeyError:  # freed meanwhile by the BPF side (a reused PID's free)
                pass

    def _idle(self, listed: set[int], gone: set[int]) -> list[tuple[int, dict[str, Any], str]]:
        """-p: the watched processes on a probed file that made no call since attach (no
        entry in ms_stats yet, LISTED: those with one), with zero counters: the user named
        them, so each keeps its row and its RSS (a server on its own slab allocator can go
        long without malloc), and one last row marked exited when it ends (GONE). One whose
        entry was evicted is not among them: it comes back at its next call, as documented."""
        if self.pids is None:
            return []
        self.counted |= listed
        zero = None
        out = []
        watched = {p for pids in self.libcs.values() for p in pids if p > 0}
        for pid in sorted(watched - self.counted):
            if pid in gone or proc.alive(pid):
                zero = zero or sum_percpu([structs.header(self.program).structs["ms_stats"]()], self.fields)
                out.append((pid, zero, self.comms.get(pid)))
        return out

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        table = self.bpf[b"ms_stats"]
        rows, gone, entries = self._per_process(table)
        procs = {}
        for pid, s, comm in rows + self._idle({pid for pid, _, _ in rows}, gone):
            calls = s["calls"]
            procs[pid] = p = {
                "pid": pid,
                "comm": comm,
                "calls": {name: int(calls[i]) for i, name in self.call_names.items()},
                "requested_bytes": int(s["requested_bytes"]),
                "allocated_bytes": int(s["allocated_bytes"]),
                "freed_bytes": int(s["freed_bytes"]),
                "live_bytes": int(s["allocated_bytes"]) - int(s["freed_bytes"]),
                "failed": int(s["failed"]),
                "size_log2": [int(x) for x in s["size_log2"]],
                "exited": pid in gone,
            }
            if s["foreign_calls"]:  # another allocator: sizes of blocks allocated since attach, as requested
                p["block_bytes"] = "requested"
            mem = None if pid in gone else proc.rss(pid)
            if mem is not None:
                p["rss_bytes"], p["rss_anon_bytes"] = mem
                p["rss_anon_base_bytes"] = self.rss_anon_base.get(pid, 0)
                p["heap_flag"] = heapefficiency.assess(p)["heap_flag"]
        self._forget_blocks([pid for pid, s, _ in rows if pid in gone and s["foreign_calls"]])
        for pid in gone:
            self._delete(table, table.Key(pid))
            self.comms.forget(pid)
            self.rss_anon_base.pop(pid, None)
            self.counted.discard(pid)
        self.evictions.update({pid: sum(p["calls"].values()) for pid, p in procs.items()}, gone)
        lost = lost_counts(
            self.bpf[b"ms_lost"], {i: "malloc_" + n for i, n in lost_names("malloc_stats", "MS").items()}
        )
        maps = {"ms_stats": self.evictions.info(entries, self.max_procs)}
        return {"time": now, "start": self.start, "processes": procs, "lost": lost, "maps": maps}
