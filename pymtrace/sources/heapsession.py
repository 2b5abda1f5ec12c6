"""One `pymtrace heap` run below the command: samples from HeapSource (BPF) unwound by each
process's ProcessImage (tracee.unwind) into a HeapProfile (sources.heapprofile).

    session = HeapSession(pids, sample_bytes=..., meta={...})
    session.attach()                 # images of the running processes, then the probes
    while running:
        session.poll()               # samples are unwound as they arrive
    profile = session.finish(older_s=None)   # in-use blocks read, probes detached
    symbolizer = session.symbolizer          # names for the writers (files kept open)

Images: a process given at the start is captured before the probes go on; a fork child when
its fork is reported; after an exec the new program is captured at once. A sample whose stack
reaches a pc in no captured file (a library mapped since: the loader at start, a dlopen)
makes the image re-read the process's maps, at most every REFRESH_S per process, and the
stack is unwound again. A process that exits before pymtrace read its maps (it lived less
than a poll interval) keeps its samples, as one unknown frame each: counted as incomplete
stacks, never dropped.

A process traced through pymtrace's interposer (INTERPOSER: the library a launched command
preloads; HeapSource.via) is sampled at its USDT site, inside the interposer: its stacks are
made to look as the uprobes give them (InterposerStacks).

BUDGET (sources.budget.Budget: --max-overhead): the probes attached in windows
(sources.budget.WindowedHeap), the profile's alloc values scaled up from them
(heapprofile.WindowedProfile), no in-use values.

A CPython process (tracee.pyruntime) has its threads' Python frames read with each sample and
shown as VIEW says (PythonStacks: merged into the native stack by default).
"""

from __future__ import annotations

import bisect
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources.heap import (
    DEFAULT_SAMPLE_BYTES,
    DEFAULT_STACK_BYTES,
    INTERPOSER,
    HeapSample,
    HeapSource,
    python_config,
)
from pymtrace.sources.heapprofile import HeapProfile, WindowedProfile
from pymtrace.sources.interposer import Credits
from pymtrace.tracee import elf, libc, mallocapi, pyframes, pyruntime
from pymtrace.tracee.unwind import UNKNOWN, Location, Module, ProcessImages, Symbolizer

if TYPE_CHECKING:
    from pymtrace.sources.budget import Budget

# sink(pid, sample_id, stack leaf first, size, ts_ns, complete): where samples go instead of the
# HeapProfile (top's live call sites: sources.stacksites)
SampleSink = Callable[[int, int, "tuple[Location, ...]", int, int, bool], None]

REFRESH_S = 0.02  # at most one re-read of a process's maps per this many seconds


class HeapSession:
    """Samples of PIDS unwound into a HeapProfile (see the module docstring)."""

    def __init__(
        self,
        pids: Iterable[int],
        sample_bytes: int = DEFAULT_SAMPLE_BYTES,
        stack_bytes: int = DEFAULT_STACK_BYTES,
        follow_forks: bool = False,
        meta: dict[str, Any] | None = None,
        libc_path: str | None = None,
        sink: SampleSink | None = None,
        ring_pages: int | None = None,
        max_live: int | None = None,
        interposer: str | None = None,
        python_view: str = pyframes.MERGED,
        python_allocators: bool = False,
        credits: Credits | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.pids = sorted(set(pids))
        self.sink = sink  # None: samples go into self.profile
        self.processes = ProcessImages(REFRESH_S)
        self.symbolizer = self.processes.symbolizer
        self.budget = budget
        if budget is None:
            self.profile = HeapProfile(sample_bytes, meta)
            source, more = HeapSource, {"on_free": self.profile.freed if sink is None else None}
        else:  # the probes in windows (the module costs ~0.1 s to import: only then)
            from pymtrace.sources.budget import WindowedHeap

            source, more = WindowedHeap, {"budget": budget}
        self.source = source(
            self.pids,
            sample_bytes=sample_bytes,
            stack_bytes=stack_bytes,
            follow_forks=follow_forks,
            on_sample=self._sample,
            on_exec=self._exec,
            images=self.processes,
            on_stack=self._cached,
            on_fork=self._fork,
            on_exit=self._exited,
            libc_path=libc_path,
            ring_pages=ring_pages,
            max_live=max_live,
            interposer=interposer,
            python=python_view != pyframes.NATIVE,
            on_python=self._python_block,
            credits=credits,
            **more,
        )
        if budget is not None:
            self.profile = WindowedProfile(sample_bytes, self.source.parts, meta)
        self.via = self.source.via
        self.python = PythonStacks(self.source, self.symbolizer, python_view, python_allocators)
        self.interposed = InterposerStacks(interposer, self.processes) if interposer else None

    # -- lifecycle
    def attach(self) -> None:
        """Capture the processes' images (a launched command stopped before its loader ran:
        its executable and loader; the rest when a stack first reaches it), then attach."""
        for pid in self.pids:
            self.processes.capture(pid, required=True)
            self.python.find(pid)
        self.source.attach()

    def probe_program(self, pid: int) -> None:
        """A launched command after an exec, its objects mapped (tracee.launch's on_exec):
        its new program's allocator probed too (HeapSource.probe_program); raises
        PymtraceError when it cannot be."""
        self.python.find(pid)
        self.source.probe_program(pid)

    def poll(self, timeout_ms: int | None = None) -> None:
        """Unwind the samples come since, waiting up to TIMEOUT_MS for one; by default 10,
        and 100 between a budget's windows, where none can come (heap's own CPU time beside
        a malloc storm: 0.5 % of a CPU, 3 % at 10; a window's first 0.1 s waits in the ring)."""
        if timeout_ms is None:
            timeout_ms = 10 if self.source.in_window else 100
        self.source.poll(timeout_ms)

    def finish(self, older_s: float | None = None, end_ns: int | None = None) -> HeapProfile:
        """Drain what is left, read the blocks still in use, detach; the finished profile.
        END_NS (CLOCK_MONOTONIC, like the BPF timestamps; default now) is "the end" that
        --older counts back from: when the run stopped, not when detaching is done."""
        if end_ns is None:
            end_ns = time.monotonic_ns()
        try:
            self.source.drain()
            live = set(self.source.live())
            drops = self.source.drops()
        finally:
            self.source.close()
        if self.budget is not None:  # every window closed: what they cost
            self.profile.meta["budget"] = self.source.summary()
        self.profile.meta["via"] = self.via_lines()
        self.profile.meta["python"] = self.python.lines()
        self.profile.finish(live, end_ns, older_s, drops=drops)
        return self.profile

    def via_lines(self) -> list[str]:
        """Which path traced each process: "pid N: interposer", "pid N: uprobes (why)"."""
        return [f"pid {pid}: {path}" + (f" ({why})" if why else "") for pid, (path, why) in sorted(self.via.items())]

    def close(self) -> None:
        self.source.close()
        self.python.close()

    # -- source callbacks (inside poll)
    def _sample(self, s: HeapSample) -> None:
        unwound = self.processes.unwind(s.pid, s.tid, s.regs, s.stack, s.stack_len)
        if unwound is None:  # gone before its maps could be read: an incomplete one-frame stack
            self._add(s, ((UNKNOWN, s.regs[0]),), False)
            return
        stack, complete = unwound
        if self.interposed is not None and self.via.get(s.pid, ("",))[0] == INTERPOSER:
            stack = self.interposed.rewrite(s.pid, stack)
        if s.py is not None:
            stack = self.python.stack(s.pid, stack, s.py)
        elif s.pid not in self.python.looked:  # a child that exec'd a Python after its exec record
            self.python.find(s.pid)
        self._add(s, stack, complete)

    def _cached(
        self, pid: int, sample_id: int, stack: tuple[Location, ...], size: int, ts_ns: int, py: bytes | None
    ) -> None:
        """A sample whose (complete) stack the unwind cache knew: no unwinding, no HeapSample."""
        if self.interposed is not None and self.via.get(pid, ("",))[0] == INTERPOSER:
            stack = self.interposed.rewrite(pid, stack)
        if py is not None:
            stack = self.python.stack(pid, stack, py)
        if self.sink is not None:
            self.sink(pid, sample_id, stack, size, ts_ns, True)
        else:
            self.profile.add(sample_id, stack, size, ts_ns, True)

    def _add(self, s: HeapSample, stack: tuple[Location, ...], complete: bool) -> None:
        if self.sink is not None:
            self.sink(s.pid, s.sample_id, stack, s.size, s.ts_ns, complete)
        else:
            self.profile.add(s.sample_id, stack, s.size, s.ts_ns, complete)

    def at_exit(self, pid: int) -> None:
        """PID is exiting but its mappings are still there (a launched command held at its
        exit, tracee.launch): capture every file it mapped since its image was read, and
        name the Python frames of the samples so far while its memory is readable."""
        self.processes.at_exit(pid)
        if self.python.has(pid):
            self.source.drain()

    def _exited(self, pid: int) -> None:
        self.python.exited(pid)

    def _python_block(self, pid: int, block: bytes) -> None:
        self.python.look(pid, block)

    def _exec(self, pid: int) -> None:
        self.python.find(pid)
        self.python.looked.discard(pid)  # its loader may map libpython later: its first sample looks again
        self.processes.forget(pid)
        try:
            self.processes.capture(pid)
        except PymtraceError:  # caught mid-exec (no ELF file mapped yet): read at its first sample
            pass
        if self.interposed is not None:
            self.interposed.forget(pid)

    def _fork(self, parent: int, child: int) -> None:
        self.processes.capture(child)
        self.python.forked(parent, child)


class PythonTargets(Protocol):
    """Where PythonStacks tells a BPF program which processes' Python frames to read and how
    (HeapSource; record --stacks' recorder.stacks.PythonMap)."""

    py_frames: int  # frames read per stack at most

    def set_python(self, pid: int, config: Any | None) -> None: ...

    def probe_python_allocators(self, pid: int, path: str) -> None: ...


class PythonStacks:
    """The Python frames of each CPython process's samples (tracee.pyframes), in VIEW: which
    interpreter each process runs (or why it cannot be read, one line each: lines()), the
    BPF program told which processes to read (HeapSource.set_python), samples' stacks
    merged (stack)."""

    MEMO = 65536  # merged stacks remembered (then forgotten and merged again)

    def __init__(
        self,
        source: HeapSource | PythonTargets,
        symbolizer: Symbolizer,
        view: str,
        allocators: bool = False,
        memo: bool = True,
        unit: str = "samples",
    ) -> None:
        self.source = source
        self.memo = memo  # native stacks are interned (HeapSource's): merged stacks remembered
        self.unit = unit  # what lines() counts
        self.view = view
        self.allocators = allocators  # sample the interpreter's allocators too (HeapSource)
        self.symbolizer = symbolizer
        self.table = pyframes.PythonFrames()
        symbolizer.add_source(pyframes.PYTHON, self.table)
        self.processes: dict[int, pyframes.PythonProcess] = {}
        self.found: dict[int, pyruntime.Interpreter] = {}
        self.looked: set[int] = set()  # processes looked at since their last exec
        self.notes: dict[int, str] = {}  # pid -> what --python-allocators cannot see there
        self.samples: dict[int, list[int]] = {}  # pid -> [samples, with frames, truncated]
        self._eval: dict[Location, bool] = {}
        self._memo: dict[tuple[int, bytes], tuple[tuple[Location, ...], tuple[Location, ...]]] = {}

    def find(self, pid: int) -> None:
        """Look for a CPython in PID (again after an exec); have its frames read if it can be."""
        self.looked.add(pid)
        old = self.processes.pop(pid, None)
        if old is not None:
            old.close()
        self.found.pop(pid, None)
        if self.view == pyframes.NATIVE and not self.allocators:
            return
        try:
            interp = pyruntime.find(pid)
        except (ProcessGone, PymtraceError):
            interp = None
        if interp is not None and self.allocators:
            local = libc.host_path(pid, interp.path)
            self.source.probe_python_allocators(pid, local)
            if "_PyObject_Malloc" not in elf.symbols(local):
                self.notes[pid] = (
                    f"--python-allocators: {os.path.basename(interp.path)} has no _PyObject_Malloc "
                    "symbol (stripped): its calls of PyObject_Malloc and PyMem_Malloc are sampled, "
                    "not those the compiler inlined (most, in a build with LTO)"
                )
        if self.view == pyframes.NATIVE:
            return
        config = None
        if interp is not None:
            self.found[pid] = interp
            if interp.problem is None:
                try:
                    self.processes[pid] = pyframes.PythonProcess(pid, interp, self.table)
                    config = python_config(interp)
                except (ProcessGone, PymtraceError):
                    pass
        self.source.set_python(pid, config)

    def forked(self, parent: int, child: int) -> None:
        """CHILD, a fork of PARENT, runs its interpreter (the BPF program copied its entry)."""
        interp = self.found.get(parent)
        if interp is None or interp.problem is not None:
            return
        self.found[child] = interp
        try:
            self.processes[child] = pyframes.PythonProcess(child, interp, self.table)
        except (ProcessGone, PymtraceError):
            return
        self.source.set_python(child, python_config(interp))

    def has(self, pid: int) -> bool:
        return pid in self.processes

    def exited(self, pid: int) -> None:
        """PID is gone: its memory is no longer read (what was named stays)."""
        process = self.processes.get(pid)
        if process is not None:
            process.close()

    def look(self, pid: int, block: bytes) -> None:
        """A sample's block as soon as it is written: its code objects read (and remembered)."""
        process = self.processes.get(pid)
        if process is not None:
            process.groups(block)

    def is_eval(self, loc: Location) -> bool:
        """Whether LOC is a frame of the evaluation loop (its outermost function's name)."""
        found = self._eval.get(loc)
        if found is None:
            frames = self.symbolizer.frames(loc)
            found = self._eval[loc] = bool(frames) and frames[-1].function == pyframes.EVAL_FUNCTION
        return found

    def stack(self, pid: int, native: tuple[Location, ...], block: bytes) -> tuple[Location, ...]:
        """NATIVE (an interned stack) with the Python frames of BLOCK, as the view says."""
        process = self.processes.get(pid)
        if process is None:
            return native
        counts = self.samples.setdefault(pid, [0, 0, 0])
        counts[0] += 1
        groups = process.groups(block)
        if not groups:
            return native
        counts[1] += 1
        counts[2] += block[4] == pyframes.TRUNCATED
        if not self.memo:
            return pyframes.merge(native, groups, self.is_eval, self.view, process.is_interpreter)
        key = (id(native), block)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is native:
            return hit[1]
        merged = pyframes.merge(native, groups, self.is_eval, self.view, process.is_interpreter)
        if len(self._memo) >= self.MEMO:
            self._memo.clear()
        self._memo[key] = (native, merged)  # the key's stack kept alive, so its id is not reused
        return merged

    def lines(self) -> list[str]:
        """One line per CPython process: its interpreter and how many samples had Python frames,
        or why its frames could not be read."""
        out = []
        for pid, interp in sorted(self.found.items()):
            line = f"pid {pid}: {interp.describe()}"
            if interp.problem is not None:
                line += "; native stacks only"
            else:
                total, with_frames, truncated = self.samples.get(pid, (0, 0, 0))
                line += f"; Python frames in {with_frames} of {total} {self.unit}"
                if truncated:
                    line += f" ({truncated} cut at {self.source.py_frames} frames)"
                unreadable = self.processes[pid].unreadable if pid in self.processes else 0
                if unreadable:
                    line += f", {unreadable} frames of unreadable code objects"
            out.append(line)
        return out + [f"pid {pid}: {note}" for pid, note in sorted(self.notes.items())]

    def problems(self) -> list[str]:
        """One line per CPython process whose frames cannot be read (which, why), or whose
        allocators --python-allocators cannot all see."""
        lines = [
            f"pid {pid}: {interp.describe()}; native stacks only"
            for pid, interp in sorted(self.found.items())
            if interp.problem is not None
        ]
        return lines + [f"pid {pid}: {note}" for pid, note in sorted(self.notes.items())]

    def close(self) -> None:
        for process in self.processes.values():
            process.close()


_WRAPPED = {f.name for f in mallocapi.FUNCTIONS} | {"reallocarray"}
_LEAVES = {"reallocarray": ("realloc", "reallocarray")}  # glibc's reallocarray calls its realloc


class InterposerStacks:
    """Stacks sampled at the interposer's USDT site (heap_alloc, inside the library), made to
    look as the uprobes give them: the interposer's frames dropped (its wrapper the program
    called, and a C++ operator's pass-through), and the function of the allocator it
    forwarded to (its first byte: where the uprobes sample) as the leaf. Once per distinct
    stack of a process; a frame of the interposer's own wrapper stays the leaf where that
    allocator cannot be told (a process gone before its first sample was read)."""

    MEMO = 65536  # rewritten stacks remembered per process (then forgotten, and made again)

    def __init__(self, lib: str, processes: ProcessImages) -> None:
        self.lib = os.path.realpath(lib)
        self.processes = processes
        symbols = elf.symbols(lib)
        ranges = sorted((s.address, s.address + s.size, n) for n, s in symbols.items() if n in _WRAPPED and s.size)
        self._starts = [r[0] for r in ranges]
        self._ranges = ranges
        self._ours: dict[Module, bool] = {}
        self._leaves: dict[int, tuple[Module, str] | None] = {}  # pid -> (allocator module, its file)
        self._memo: dict[int, dict[int, tuple[tuple[Location, ...], tuple[Location, ...]]]] = {}

    def forget(self, pid: int) -> None:
        """PID exec'd: another program, maybe another allocator."""
        self._leaves.pop(pid, None)
        self._memo.pop(pid, None)

    def rewrite(self, pid: int, stack: tuple[Location, ...]) -> tuple[Location, ...]:
        """STACK (leaf first, unwound from the site) as the uprobes would give it."""
        memo = self._memo.setdefault(pid, {})
        hit = memo.get(id(stack))
        if hit is not None and hit[0] is stack:  # stacks are interned: the same object again
            return hit[1]
        out = self._rewrite(pid, stack)
        if len(memo) >= self.MEMO:
            memo.clear()
        memo[id(stack)] = (stack, out)  # the key's object kept alive, so its id is not reused
        return out

    def _is_ours(self, module: Module) -> bool:
        ours = self._ours.get(module)
        if ours is None:
            ours = self._ours[module] = module.path == self.lib or os.path.realpath(module.path) == self.lib
        return ours

    def _rewrite(self, pid: int, stack: tuple[Location, ...]) -> tuple[Location, ...]:
        lead = 0
        while lead < len(stack) and self._is_ours(stack[lead][0]):
            lead += 1
        if lead == 0:
            return stack
        outer = stack[lead - 1]  # the wrapper the program called
        rest = tuple(loc for loc in stack[lead:] if not self._is_ours(loc[0]))
        i = bisect.bisect_right(self._starts, outer[1]) - 1
        name = self._ranges[i][2] if i >= 0 and outer[1] < self._ranges[i][1] else None
        found = self._allocator(pid) if name else None
        if found is None:
            return (outer, *rest)
        module, path = found
        symbols = elf.symbols(path)
        leaves = tuple((module, symbols[n].address) for n in _LEAVES.get(name, (name,)) if n in symbols)
        return (*(leaves or (outer,)), *rest)

    def _allocator(self, pid: int) -> tuple[Module, str] | None:
        """(PID's allocator as a Module of its image, its file): the object its calls go on to."""
        if pid in self._leaves:
            return self._leaves[pid]
        image = self.processes.images.get(pid)
        found = None
        if image is not None:
            try:
                allocator = libc.allocator(pid, skip=(self.lib,))
                path = allocator.path if allocator is not None else None
            except (ProcessGone, PymtraceError, OSError):
                path = next((m.path for m in image.modules if libc.is_libc_path(m.path)), None)
            if path is not None:
                real = os.path.realpath(path)
                module = next((m for m in image.modules if os.path.realpath(m.path) == real), None)
                found = (module, path) if module is not None else None
        self._leaves[pid] = found
        return found
