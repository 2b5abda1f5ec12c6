"""record --stacks: each allocation's stack event unwound as it is drained, and the records
labelled with the ids of their stacks in the per-process stack tables.

In a CPython process a stack event also carries its thread's Python frames (bpf/record.bpf.c
py_output, bpf/pywalk.h): their code objects are named as the event is drained, while the
process lives (cached per code object, tracee.pyframes), and merged into the native stack
(each _PyEval_EvalFrameDefault frame replaced by the Python frames it ran) before the stack
is interned, so equal merged stacks share an id."""

from __future__ import annotations

import bisect
import ctypes
import os
import re
import time
from typing import Any, Callable

from pymtrace.bpf import structs
from pymtrace.errors import PymtraceError, WriteFailed
from pymtrace.recorder.outputs import Output, table_path_of
from pymtrace.trace.formats import mtrace_bin
from pymtrace.tracee import elf, mallocapi

_ALLOC_TYPES = (
    mtrace_bin.MALLOC,
    mtrace_bin.CALLOC,
    mtrace_bin.REALLOC,
    mtrace_bin.MEMALIGN,
    mtrace_bin.VALLOC,
    mtrace_bin.PVALLOC,
    mtrace_bin.POSIX_MEMALIGN,
)
_PYTHON_FILE = re.compile(r"/(lib)?python\d[^/]*$")  # a CPython executable or libpython
_MAX_PENDING = 1 << 16  # unmatched stacks (their record was lost) kept before pruning


class PythonMap:
    """record.bpf.c's map `py` (tgid -> py_config), as PythonStacks writes it: before the
    program is loaded the configurations are kept, and written by attach."""

    def __init__(self, py_frames: int) -> None:
        self.py_frames = py_frames
        self.bpf: Any = None
        self.python: dict[int, Any] = {}

    def attach(self, bpf: Any) -> None:
        self.bpf = bpf
        for pid, config in self.python.items():
            self.set_python(pid, config)

    def set_python(self, pid: int, config: Any | None) -> None:
        if config is None:
            self.python.pop(pid, None)
        else:
            self.python[pid] = config
        if self.bpf is None:
            return
        from pymtrace.sources.heap import write_python  # (as PY_FRAMES: only with Python frames)

        write_python(self.bpf[b"py"], pid, config)

    def probe_python_allocators(self, pid: int, path: str) -> None:  # heap's --python-allocators only
        pass


class StackUnwinder:
    """record --stacks: unwinds each allocation's stack event (ring buffer `stacks`) with its
    process's ProcessImage as it is drained, and labels the records with stack ids.

    BPF copies the registers and stack at the allocating function's return: ip is then the
    return address in its caller and the callee-saved registers hold the caller's values, so
    the unwind starts in the caller; the allocating function itself is added as the leaf
    (libc's symbol), and the caller's pc becomes return address - 1 like every other caller."""

    def __init__(self, libc_path: str, python: bool = True, processes: Any = None) -> None:
        """PROCESSES: the ProcessImages to share (one recording's stacks, in-process and
        through uprobes, named by one symbolizer)."""
        from pymtrace.sources.heap import PY_FRAMES
        from pymtrace.sources.heapsession import PythonStacks
        from pymtrace.tracee import pyframes
        from pymtrace.tracee.unwind import ProcessImages

        self.leaf_files: list[tuple[str, dict[int, int]]] = []  # (real path, {call: pc}), preferred first
        self.processes = processes if processes is not None else ProcessImages()
        self.symbolizer = self.processes.symbolizer
        self.pending: dict[tuple[int, int], tuple[int, tuple, bool]] = {}
        self.missing = 0  # allocation records written with stack id 0
        self.incomplete = 0  # stacks whose unwind did not reach the outermost frame
        self.cpu = 0.0  # CPU time spent taking and unwinding the stack events (the recorder adds it)
        self.event = structs.header("record").structs["stack_event"]
        self.event_size = ctypes.sizeof(self.event)
        self.add_leaf_file(libc_path)
        self.libc_module: dict[tuple[int, int], Any] = {}  # (image, its file count): (Module, {call: pc})
        # PYTHON: CPython processes' stacks carry their Python frames (merged)
        self.py_map = PythonMap(PY_FRAMES) if python else None
        self.python = (
            PythonStacks(self.py_map, self.symbolizer, pyframes.MERGED, memo=False, unit="allocations")
            if self.py_map is not None
            else None
        )
        self.py_head = self.py_frame = 0
        if python:
            header = structs.header("record").structs
            self.py_head = ctypes.sizeof(header["py_head"])
            self.py_frame = ctypes.sizeof(header["py_frame"])

    def find_python(self, pid: int) -> None:
        """Look for a CPython in PID (at start, after an exec): its frames read if it can be."""
        if self.python is not None:
            self.python.find(pid)

    def attach(self, bpf: Any) -> None:
        """BPF (record.bpf.c, loaded) gets the Python processes found so far."""
        if self.py_map is not None:
            self.py_map.attach(bpf)

    def python_lines(self) -> list[str]:
        """One line per CPython process: its interpreter, how many stacks had Python frames,
        or why its frames could not be read (PythonStacks.lines)."""
        return self.python.lines() if self.python is not None else []

    def _py_block(self, data: int, size: int, stack_len: int) -> bytes | None:
        """The Python block (bpf/pyframes.h) after the stack of the event at DATA, or None."""
        at = self.event_size + ((stack_len + 7) & ~7)
        if not self.py_head or size < at + self.py_head:
            return None
        count = min(ctypes.c_uint32.from_address(data + at).value, (size - at - self.py_head) // self.py_frame)
        return ctypes.string_at(data + at, self.py_head + count * self.py_frame)

    def add_leaf_file(self, path: str) -> None:
        """Name the allocating functions of PATH (the allocator a program calls: glibc, or one
        a `record -- CMD` exec'd into) as the leaf of a stack in a process that maps it;
        the file added last is preferred."""
        leaf_pc: dict[int, int] = {}
        for function in mallocapi.FUNCTIONS:
            code = getattr(mtrace_bin, function.call.upper(), None)
            if code in _ALLOC_TYPES and code not in leaf_pc:
                try:
                    leaf_pc[code] = elf.symbol(path, function.name).address
                except PymtraceError:
                    pass
        real = os.path.realpath(path)
        self.leaf_files = [(real, leaf_pc)] + [f for f in self.leaf_files if f[0] != real]
        self.libc_module = {}

    def capture(self, pid: int) -> None:
        """Read PID's image now (a running process, before the probes go on)."""
        self.processes.capture(pid, required=True)

    def at_exit(self, pid: int) -> None:
        """A held command at its exit: read the files it mapped since (target.launch)."""
        self.processes.at_exit(pid)

    def _libc(self, pid: int, image: Any) -> Any:
        """(the allocator's Module in IMAGE, its {call: leaf pc}), or None."""
        key = (id(image), len(image.modules))
        found = self.libc_module.get(key)
        if found is None:
            reals = {os.path.realpath(m.path): m for m in image.modules}
            found = next(((reals[real], pcs) for real, pcs in self.leaf_files if real in reals), False)
            self.libc_module[key] = found
        return found or None

    def on_event(self, _ctx: Any, data: int, size: int) -> int:
        """BCC's ring buffer callback: unwind one stack event now (its bytes live only here)."""
        from pymtrace.tracee.unwind import UNKNOWN

        ev = ctypes.cast(data, ctypes.POINTER(self.event)).contents
        tgid, tid, call, ts = int(ev.tgid), int(ev.tid), int(ev.call), int(ev.ts)
        regs = list(ev.regs)
        length = min(int(ev.stack_len), size - self.event_size)
        unwound = self.processes.unwind(tgid, tid, regs, data + self.event_size, length)
        if unwound is None:  # gone before its maps could be read
            stack, complete = ((UNKNOWN, regs[0]),), False
        else:
            image = self.processes.images[tgid]
            stack, complete = unwound
            if stack:  # the unwind began at the return address: the call is before it
                stack = ((stack[0][0], stack[0][1] - 1),) + tuple(stack[1:])
            leaf = self._libc(tgid, image)
            if leaf is not None and call in leaf[1]:
                stack = ((leaf[0], leaf[1][call]),) + tuple(stack)
        python = self.python
        if python is not None:
            block = self._py_block(data, size, int(ev.stack_len))
            if block is not None:
                stack = python.stack(tgid, tuple(stack), block)
            elif tgid not in python.looked:  # a process seen first now (a followed child, an exec)
                python.find(tgid)
        if not complete:
            self.incomplete += 1
        if len(self.pending) >= _MAX_PENDING:
            self._prune(ts)
        self.pending[(tid, ts)] = (tgid, stack, complete)
        return 0

    def _prune(self, now_ns: int) -> None:
        """Drop stacks older than 10 s whose record never came (the record itself was lost), and
        the older half if that is not enough: memory stays bounded."""
        kept = {k: v for k, v in self.pending.items() if now_ns - k[1] < 10_000_000_000}
        if len(kept) >= _MAX_PENDING // 2:
            kept = dict(sorted(kept.items(), key=lambda kv: kv[0][1])[len(kept) // 2 :])
        self.pending = kept

    def label(
        self, recs: bytes | bytearray, n: int, tg: Any, target: int, output_for: Callable[[int], Output]
    ) -> bytearray:
        """RECS (N records; TG: their processes, or None: all TARGET's) with each allocation's
        stack id in bits 8-31 of its type word; the new stacks are written to the tables first."""
        import numpy

        buf = bytearray(recs)
        words = numpy.frombuffer(buf, dtype="<u4").reshape(n, mtrace_bin.RECORD_SIZE // 4)
        ts = numpy.frombuffer(buf, dtype="<u8").reshape(n, mtrace_bin.RECORD_SIZE // 8)[:, 6]
        allocs = numpy.nonzero(numpy.isin(words[:, 1] & 0xFF, _ALLOC_TYPES))[0]
        threads = words[allocs, 0].tolist()
        stamps = ts[allocs].tolist()
        tgids = [target] * len(allocs) if tg is None else [int(tg[i]) for i in allocs.tolist()]
        ids = []
        touched = set()
        pending = self.pending
        for thread, stamp, tgid in zip(threads, stamps, tgids):
            entry = pending.pop((thread, stamp), None)
            out = output_for(tgid)
            if entry is None or out.stack_table is None:
                self.missing += 1
                ids.append(0)
                continue
            ids.append(out.stack_table.intern(entry[1], entry[2]))
            touched.add(out)
        if len(allocs):
            words[allocs, 1] |= numpy.array(ids, dtype="<u4") << 8
        for out in touched:  # the stacks before the records that name them
            try:
                out.stack_table.flush()
            except OSError as exc:
                out.failed = exc
                raise WriteFailed(f"cannot write {table_path_of(out.path)}: {exc.strerror or exc}") from None
        return buf


class RingStacks(StackUnwinder):
    """record --stacks in-process: the interposer unwinds each allocation in the process
    (libunwind), interns its stack in the ring's table and names the objects it had loaded
    (tracee/native/interpose.h); the records carry the ring's ids. Here each id first seen
    (Batch.stacks) is located in those objects (its process may have ended: a short-lived
    child's stacks too), given the allocating function as its leaf like StackUnwinder's
    stacks, and interned in the output's stack table; the records' ids are then rewritten to
    the table's, a numpy lookup per batch. The objects' files are opened here to name frames."""

    def __init__(self, libc_path: str) -> None:
        super().__init__(libc_path, python=False)
        self.luts: dict[tuple[int, int], Any] = {}  # (pid, image) -> ring id -> table id (uint64)
        self.cut: dict[tuple[int, int], Any] = {}  # ... -> whether the stack was cut (bool)
        self.mapped: dict[tuple[int, int], list] = {}  # ... -> [(start, end, bias, Module)] by start
        self.starts: dict[tuple[int, int], list] = {}  # ... -> their starts (bisect)
        self.leaf: dict[tuple[int, int], Any] = {}  # ... -> (allocator's Module, {call: pc}) or None
        self.files: dict[str, Any] = {}  # real path -> its Module (without a build ID: unreadable)
        self.python_native: dict[int, str] = {}  # CPython processes (their stacks are native): pid -> file

    def add_leaf_file(self, path: str) -> None:
        super().add_leaf_file(path)
        for key in getattr(self, "mapped", {}):  # (StackUnwinder's __init__ adds libc's first)
            self._find_leaf(key)

    def _find_leaf(self, key: tuple[int, int]) -> None:
        """KEY's allocator among its modules (their paths are real paths: _module), preferred
        as leaf_files orders them, and its {call: pc}; None if it maps none of them."""
        reals = {e[3].path: e[3] for e in self.mapped[key]}
        self.leaf[key] = next(((reals[real], pcs) for real, pcs in self.leaf_files if real in reals), None)

    def forget(self, pid: int) -> None:
        """PID exec'd: a program traced through uprobes from here on is unwound with its own files."""
        self.processes.forget(pid)

    def _module(self, m: Any) -> Any:
        """The Module of M's file (an interposer.Module), its file opened to name its frames."""
        from pymtrace.tracee.unwind import Module, RecordedImage, module_path

        real = os.path.realpath(m.path)
        if real not in self.files:
            module = None
            try:
                image = RecordedImage(m.start, m.end, 0, real, real)  # mapped where it was
            except PymtraceError:
                pass
            else:
                if image.modules:
                    module = image.modules[0]
                    self.symbolizer.add(image)
            self.files[real] = module or Module(module_path(real), "")
        return self.files[real]

    def _add_modules(self, key: tuple[int, int], modules: Any) -> None:
        mapped = self.mapped.setdefault(key, [])
        for m in modules:
            mapped.append((m.start, m.end, m.bias, self._module(m)))
            if _PYTHON_FILE.search(m.path):
                self.python_native.setdefault(key[0], m.path)
        mapped.sort(key=lambda e: e[0])
        self.starts[key] = [e[0] for e in mapped]
        self._find_leaf(key)

    def _stack(self, key: tuple[int, int], call: int, ips: tuple[int, ...]) -> tuple:
        from pymtrace.tracee.unwind import UNKNOWN

        mapped, starts = self.mapped.get(key, []), self.starts.get(key, [])
        frames = []
        for ip in ips:
            pc = ip - 1  # a return address: the call is the instruction before
            i = bisect.bisect_right(starts, pc) - 1
            while i >= 0 and not mapped[i][0] <= pc < mapped[i][1]:
                i -= 1
            frames.append((mapped[i][3], pc - mapped[i][2]) if i >= 0 else (UNKNOWN, pc))
        leaf = self.leaf.get(key)
        if leaf is not None and call in leaf[1]:
            frames.insert(0, (leaf[0], leaf[1][call]))
        return tuple(frames)

    def label_batch(self, batch: Any, out: Output) -> None:
        """BATCH's records (interposer.Batch, written in place) with the ids of OUT's stack table
        in bits 8-31 of their type words; new stacks are written to the table first."""
        import numpy

        t0 = time.thread_time()
        words = numpy.frombuffer(batch.data, dtype=numpy.uint64).reshape(batch.count, mtrace_bin.RECORD_SIZE // 8)
        key = (batch.pid, batch.generation)
        lut, cut = self.luts.get(key), self.cut.get(key)
        if lut is None:
            lut, cut = numpy.zeros(1024, dtype=numpy.uint64), numpy.zeros(1024, dtype=bool)
        if batch.modules:
            self._add_modules(key, batch.modules)
        local = (words[:, 0] >> numpy.uint64(40)) & numpy.uint64(0xFFFFFF)
        if batch.stacks:
            top = max(batch.stacks)
            if top >= len(lut):
                size = 1 << top.bit_length()
                lut = numpy.concatenate([lut, numpy.zeros(size - len(lut), dtype=numpy.uint64)])
                cut = numpy.concatenate([cut, numpy.zeros(size - len(cut), dtype=bool)])
            table = out.stack_table
            for sid, new in batch.stacks.items():
                stack = self._stack(key, new.call, new.ips)
                lut[sid] = table.intern(stack, not new.cut) if table is not None else 0
                cut[sid] = new.cut
            if table is not None:
                try:
                    table.flush()  # the stacks before the records that name them
                except OSError as exc:
                    out.failed = exc
                    raise WriteFailed(f"cannot write {table_path_of(out.path)}: {exc.strerror or exc}") from None
        self.luts[key], self.cut[key] = lut, cut
        local[local >= len(lut)] = 0
        ids = lut[local]
        allocs = numpy.isin((words[:, 0] >> numpy.uint64(32)) & numpy.uint64(0xFF), _ALLOC_TYPES)
        self.missing += int(numpy.count_nonzero(allocs & (ids == 0)))
        self.incomplete += int(numpy.count_nonzero(allocs & cut[local]))
        words[:, 0] = (words[:, 0] & numpy.uint64(0xFFFFFFFFFF)) | (ids << numpy.uint64(40))
        self.cpu += time.thread_time() - t0
