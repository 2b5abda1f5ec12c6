"""The bundle of sources that `top` and the exporter run (Sources): attached together, their
programs compiled as one BCC module, one process-exit watcher, one merged snapshot
(pymtrace.sources.snapshot). The lifecycle each source follows: pymtrace.sources.base.Source."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import uprobes
from pymtrace.errors import NotRootError, ProcessGone, PymtraceError
from pymtrace.sources import snapshot as snapshot_model
from pymtrace.sources.base import Source, check_pids, watch_exits
from pymtrace.sources.faults import FaultSource
from pymtrace.sources.glibc import GlibcSource
from pymtrace.sources.malloc import MallocSource
from pymtrace.sources.slab import SlabSource
from pymtrace.tracee import libc

if TYPE_CHECKING:
    from pymtrace.sources.budget import Budget
    from pymtrace.tracee.procevents import ProcEvent


class Sources:
    """The sources top runs, attached together, with one merged snapshot and one
    process-exit watcher; their programs are compiled as ONE BCC module (attach()).
    glibc=True adds pymtrace.sources.glibc.GlibcSource (contained: its failures are
    reported in snapshot["errors"]["glibc"], not raised). Likewise slab and faults when this
    kernel cannot run them (snapshot["errors"][name]); malloc's failures are raised.
    budget: malloc's uprobes attached in windows under that overhead budget
    (pymtrace.sources.budget.WindowedMalloc: estimated counters)."""

    def __init__(
        self,
        pids: Iterable[int | str] | None = None,
        malloc: bool = True,
        slab: bool = True,
        faults: bool = True,
        glibc: bool = True,
        track_exits: bool = True,
        budget: Budget | None = None,
    ) -> None:
        self.pids = check_pids(pids)
        self.sources = {}
        self.errors = {}
        self.notes = []  # lines to show once (libc files left out of a system-wide attach)
        self.allocators = libc.AllocatorCache()
        self.track_exits = track_exits
        self._events = None
        self.start = None
        self.bpf = None  # the one BCC module of every source
        if malloc and budget is not None:  # the per-call uprobes in windows
            from pymtrace.sources.budget import WindowedMalloc

            self.sources["malloc"] = WindowedMalloc(self.pids, budget, track_exits=False)
        elif malloc:
            self.sources["malloc"] = MallocSource(self.pids, track_exits=False)
        if faults:
            self.sources["faults"] = FaultSource(self.pids, track_exits=False)
        if slab:
            self.sources["slab"] = SlabSource()
        if glibc:  # aggregates only: no ring buffer (the fault reader polls the module's)
            self.sources["glibc"] = GlibcSource(self.pids, track_exits=False)

    def attach(self) -> Sources:
        """One BCC compile for every source's program, made before any uprobe is attached
        (a compile under top's malloc uprobes runs ~10x slower: BCC's clang is one of the
        processes they trap), while the malloc source decodes its libcs. Then slab,
        faults and glibc attach, and the per-call malloc uprobes last."""
        self.start = time.monotonic()
        compiling = None
        try:
            self._prepare()
            parts = [p for p in (c.part() for c in self.sources.values()) if p is not None]
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pymtrace-bpf-compile")
            compiling = pool.submit(self._compile, parts)  # BCC's C++ releases the GIL
            pool.shutdown(wait=False)
            for c in list(self.sources.values()):
                c.plan()
            self.bpf, compiling = compiling.result(), None
            for name, c in sorted(self.sources.items(), key=lambda item: item[1].attach_order):
                if c.contained:
                    self._contain(name, c.attach, self.bpf)
                else:
                    c.attach(self.bpf)
            if self.track_exits:
                self._events = watch_exits(self._on_event)
        except BaseException:
            if compiling is not None:  # failed while compiling: the module is closed below
                try:
                    self.bpf = compiling.result()
                except BaseException:  # the compile's own failure: the one being raised already
                    pass
            self.close()
            raise
        malloc = self.sources.get("malloc")
        if malloc is not None:  # only processes on these files are counted (rows say so)
            self.allocators.probed = {libc.file_key(path) for path in malloc.libcs}
        note = libc.skipped_note(getattr(malloc, "skipped", None))
        if note:
            self.notes.append(note)
        return self

    def _contain(self, name: str, step: Callable[..., object], *args: Any) -> bool:
        """STEP(*ARGS) of the contained source NAME; a failure goes to errors[name] and
        drops the source. True if it succeeded."""
        try:
            step(*args)
            return True
        except PymtraceError as exc:
            self.errors[name] = str(exc)
        except Exception as exc:  # its bugs must not take top down: reported in errors[name]
            self.errors[name] = f"{type(exc).__name__}: {exc}"
        self.sources.pop(name, None)
        return False

    def _prepare(self) -> None:
        """prepare() each source; slab and faults that cannot work on this kernel (e.g. a
        missing tracepoint) are dropped with the reason in errors[name], the rest go on."""
        for name, c in list(self.sources.items()):
            if c.contained:
                self._contain(name, c.prepare)
                continue
            try:
                c.prepare()
            except (ProcessGone, NotRootError):
                raise
            except PymtraceError as exc:
                if c.required:
                    raise
                self.errors[name] = str(exc)
                del self.sources[name]

    def _compile(self, parts: Sequence[bpfload.Part]) -> Any:
        if not parts:
            return None
        what = "tracing memory allocations"
        owners = {c.program: name for name, c in self.sources.items()}
        try:
            return bpfload.load_parts(parts, what=what)
        except NotRootError:
            raise
        except PymtraceError as exc:
            if len(parts) == 1:
                name = owners.get(parts[0].program, parts[0].program)
                if self.sources[name].fallback(str(exc)):
                    return self._compile([self.sources[name].part()])
                if not self.sources[name].contained:
                    raise
                self.errors[name] = str(exc)
                del self.sources[name]
                return None
            first = exc
        # One program this kernel cannot compile (a tracepoint field, a map type it lacks)
        # must not take the others down: compile each alone to find it (a second try only
        # on this failure path), drop it with the reason in errors[...], compile the rest.
        keep = []
        for part in parts:
            name = owners.get(part.program, part.program)
            try:
                part = self._alone(part, self.sources[name], what)
            except PymtraceError as exc:
                if self.sources[name].required:  # what top is for: not a view to leave empty
                    raise
                self.errors[name] = str(exc)
                self.sources.pop(name, None)
                continue
            keep.append(part)
        if not keep:
            raise first
        return bpfload.load_parts(keep, what=what)

    @staticmethod
    def _alone(part: bpfload.Part, source: Source, what: str) -> bpfload.Part:
        """PART if it compiles and loads alone (then detached), else the source's fallback
        part if it has one that does (Source.fallback); PymtraceError when neither."""
        while True:
            try:
                bpfload.detach_all(bpfload.load_parts([part], what=what))
                return part
            except PymtraceError as exc:
                if not source.fallback(str(exc)):
                    raise
                part = source.part()

    def _on_event(self, ev: ProcEvent) -> None:
        for c in self.sources.values():
            c.on_process_event(ev)

    def exited(self, tgid: int) -> None:
        for c in self.sources.values():
            c.exited(tgid)

    def snapshot(self) -> snapshot_model.Snapshot:
        # The snapshot's time is when reading began: every event before it is in the counts.
        # Stamped after reading, it would claim events the first sources' maps were read
        # too early to hold (seconds apart on a slow machine: an emulated VM, a busy host).
        began = time.monotonic()
        parts = []
        for name, c in list(self.sources.items()):
            try:
                parts.append(c.snapshot())
            except PymtraceError:
                raise
            except Exception as exc:
                if not c.contained:
                    raise
                self.errors[name] = f"{type(exc).__name__}: {exc}"  # its bugs must not take top down
        snap = snapshot_model.merge(parts)
        snap["start"] = self.start  # the bundle's attach, before any source's
        snap["time"] = began
        if "malloc" in self.sources:  # whose malloc each process calls (not glibc's: not traced)
            self.allocators.annotate(snap["processes"], self.pids or ())
        if self.errors:
            snap["errors"] = dict(self.errors)
        return snap

    def close(self) -> None:
        if self._events is not None:
            self._events.stop()
            self._events = None
        for name, c in self.sources.items():  # their threads stop; the shared module stays
            try:
                c.close()
            except Exception as exc:  # one source's failure must not keep the others attached
                self.errors.setdefault(name, f"closing: {type(exc).__name__}: {exc}")
        uprobes.detach(self.bpf)
        self.bpf = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.close()
