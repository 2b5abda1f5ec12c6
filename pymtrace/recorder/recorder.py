"""The recorder behind `pymtrace record`: every malloc-API call of a process into a trace file.

Data path: BPF uprobes/uretprobes on glibc's malloc functions (bpf/record.bpf.c) write
complete 64-byte dj/malloc records into a BPF ring buffer (no wakeups). The recorder reads
the ring buffer's pages itself (pymtrace.bpf.ringbuf: no per-event callback), and every
poll copies all committed records out of it with a few strided copies and one write(2):
no per-event Python work.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import mmap
import os
import select
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from pymtrace import stopping
from pymtrace.bpf import load as bpfload
from pymtrace.bpf import structs, uprobes
from pymtrace.bpf.ringbuf import RingReader
from pymtrace.errors import ProcessGone, PymtraceError, WriteFailed
from pymtrace.sources.base import uprobe
from pymtrace.trace import stacktable
from pymtrace.trace.files import open_exclusive, open_unique
from pymtrace.trace.formats import mtrace_bin, mtrace_text
from pymtrace.tracee import allocators, elf, libc, mallocapi, probesite, proc

if TYPE_CHECKING:
    import argparse

    import numpy

    from pymtrace.tracee.launch import Launched

EXIT_LOST = 3  # events were lost (the ring buffer was full), unless --allow-drops
_PAGE = mmap.PAGESIZE
_DEBUG_LIB = "libc_malloc_debug.so.0"
_RECORD = struct.Struct("<" + mtrace_bin.RECORD_FORMAT)
_B_FREE = mtrace_bin.FREE
_B_PLUS = (mtrace_bin.MALLOC, mtrace_bin.CALLOC, mtrace_bin.MEMALIGN, mtrace_bin.VALLOC, mtrace_bin.PVALLOC)


# ---------------------------------------------------------------- output files


def close_outputs(outputs: list) -> WriteFailed | None:
    """Close every output (Output, NetOutput); the first WriteFailed, if any. The network
    outputs' ends are begun together first (begin_close), so with --follow-forks the end
    waits one --send-timeout in all, not one per process."""
    for out in outputs:
        if hasattr(out, "begin_close"):
            out.begin_close()
    failure = None
    for out in outputs:
        try:
            out.close()
        except WriteFailed as exc:
            failure = failure or exc
    return failure


class Output:
    """One process's trace, written as it is recorded: the MAGIC record then raw records
    (mtrace-bin), "= Start" then glibc's text lines (mtrace-text), or Parquet row groups
    (parquet; METADATA: its key-value metadata). A failed write cuts the file back to its
    last complete record (parquet: row group) and raises WriteFailed."""

    def __init__(
        self,
        path: str,
        fd: int,
        fmt: str,
        tgid: int,
        fallback_maps: Callable[[Output], None] | None = None,
        metadata: dict[str, str] | None = None,
        stacks: bool = False,
        allocator: str | None = None,
    ) -> None:
        self.path = path
        self.allocator = allocator or "glibc"
        self.stacks = stacks
        self.stack_table: stacktable.TableWriter | None = None  # record --stacks: set by the recorder
        self.fmt = fmt
        self.tgid = tgid
        self.fd = fd
        self.counts = [0] * 9
        self.entries = 0
        self.bytes_written = 0
        self.failed = None
        self.resolver = mtrace_text.CallerResolver() if fmt == "mtrace-text" else None
        self.fallback_maps = fallback_maps  # adds the maps BPF saw, for a process gone from /proc
        self.last_refresh = 0.0
        self.parquet = None
        if fmt == "parquet":
            from pymtrace.trace.formats import parquet  # pyarrow: imported only when needed

            try:
                self.parquet = parquet.Writer(fd, metadata, stacks=stacks)
            except OSError as exc:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}") from None
            self.bytes_written = self.parquet.size
            self._dtype = mtrace_bin.record_dtype("<")
            return
        head = (
            b"= Start\n"
            if self.resolver is not None
            else mtrace_bin.magic_record(tgid, stacks=stacks, allocator=allocator)
        )
        _, exc = self._put(head, [])
        if exc is not None:
            os.close(fd)
            try:
                os.unlink(path)  # holds nothing
            except OSError:
                pass
            raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}")

    def set_allocator(self, family: str, path: str | None) -> None:
        """Name FAMILY (in PATH) as the recorded allocator (`record -- CMD` after an exec into a
        program on another allocator): the MAGIC record rewritten in place (mtrace-bin), the
        metadata in a new footer (parquet)."""
        if self.fmt == "mtrace-text" or self.failed is not None or family == self.allocator:
            return
        self.allocator = family
        try:
            if self.parquet is not None:
                items = {"pymtrace.allocator": family}
                if path:
                    items["pymtrace.allocator_path"] = path
                self.parquet.update_metadata(items)
            else:
                os.pwrite(self.fd, mtrace_bin.magic_record(self.tgid, stacks=self.stacks, allocator=family), 0)
        except OSError as exc:
            self.failed = exc
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def _put(self, blob: bytes | bytearray, ends: Sequence[int]) -> tuple[int, OSError | None]:
        """Append BLOB; ENDS: where each of its records ends in it. Returns how many of them
        are in the file: all, or, when the write fails, those written whole (WriteFailed)."""
        view = memoryview(blob)
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        except OSError as exc:
            kept = bisect.bisect_right(ends, done)
            keep = self.bytes_written + (ends[kept - 1] if kept else 0)
            if not ends:  # the file's header itself
                keep = 0
            try:
                os.ftruncate(self.fd, keep)
            except OSError:
                pass
            self.bytes_written = keep
            self.failed = exc
            return kept, exc
        self.bytes_written += done
        return len(ends), None

    def write(self, data: bytes, n: int) -> None:
        rs = mtrace_bin.RECORD_SIZE
        if self.parquet is not None:
            import numpy

            self._parquet_step(self.parquet.write_records, numpy.frombuffer(data, self._dtype, count=n))
            return
        if self.resolver is None:
            blob, ends = data, range(rs, (n + 1) * rs, rs)
        else:
            blob, ends = self._text(data)
        kept, exc = self._put(blob, ends)
        types = bytes(data[4 : kept * rs : rs])  # ~0.014 us/event
        for t in range(1, 9):
            self.counts[t] += types.count(t)
        self.entries += kept
        if exc is not None:
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")

    def write_words(self, words: numpy.ndarray) -> None:
        """Parquet: records as an (N, 8) uint64 array of their words (a view of the ring buffer:
        copied once, into the writer's columns)."""
        self._parquet_step(self.parquet.write_words, words)

    def _parquet_step(self, step: Callable[..., object], *args: object) -> None:
        """Run a parquet Writer step; count the rows it put in the file; WriteFailed on OSError."""
        try:
            step(*args)
        except OSError as exc:
            self.failed = exc
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}") from None
        finally:
            self.counts = list(self.parquet.type_counts)
            self.entries = self.parquet.rows
            self.bytes_written = self.parquet.size

    def poll(self) -> None:
        """Called on every poll: parquet writes a row group when its oldest row is old enough."""
        if self.parquet is not None and self.failed is None:
            self._parquet_step(self.parquet.maybe_flush)

    def _text(self, data: bytes | bytearray) -> tuple[bytes, list[int]]:
        """glibc's text lines for the records in DATA, as one blob, and each record's end in it.
        The lines of mtrace_text.record_lines, inlined for the common calls (~1 us a record:
        this runs while recording)."""
        rows = list(_RECORD.iter_unpack(data))
        self._resolve_all({r[8] for r in rows})
        resolve = self.resolver
        parts, ends, pos = [], [], 0
        for row in rows:
            _, ty, p1, p2, size, _, _, _, caller = row
            ty &= 0xFF
            where = resolve(caller)
            at = f"@ {where} " if where else ""
            if ty == _B_FREE:
                text = f"{at}- {p1:#x}\n" if p1 else ""
            elif ty in _B_PLUS and p2 and size:
                text = f"{at}+ {p2:#x} {size:#x}\n"
            else:
                lines = mtrace_text.record_lines(mtrace_bin.Record(row[0], ty, *row[2:]), where)
                text = "".join(line + "\n" for line in lines)
            parts.append(text)
            pos += len(text)
            ends.append(pos)
        return "".join(parts).encode(), ends

    def _resolve_all(self, callers: Iterable[int]) -> None:
        """Read the maps again (or take BPF's) if a caller is in no module known yet (a
        library loaded since the last snapshot); at most every 0.2 s."""
        now = time.monotonic()
        if now - self.last_refresh < 0.2:
            return
        if any(a and self.resolver(a).startswith("[") for a in set(callers)):
            self.last_refresh = now
            if not self.snapshot_maps() and self.fallback_maps is not None:
                self.fallback_maps(self)

    def snapshot_maps(self) -> bool:
        """Add the process's current maps to the caller resolver (mtrace-text); whether it could."""
        if self.resolver is not None:
            try:
                self.resolver.add_maps(libc.read_maps(self.tgid))
                return True
            except (PymtraceError, OSError):
                pass
        return False

    def close(self) -> None:
        if self.stack_table is not None:
            table, self.stack_table = self.stack_table, None
            try:
                table.close()
            except OSError as exc:
                self.failed = self.failed or exc
                raise WriteFailed(f"cannot write {table_path_of(self.path)}: {exc.strerror or exc}") from None
        if self.parquet is not None and self.failed is None:
            try:
                self._parquet_step(self.parquet.close)
            finally:
                os.close(self.fd)
            return
        if self.resolver is not None and self.failed is None:
            _, exc = self._put(b"= End\n", [6])
            if exc is not None:
                os.close(self.fd)
                raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")
        os.close(self.fd)

    def summary(self) -> dict:
        return {
            "file": self.path,
            "pid": self.tgid,
            "format": self.fmt,
            "entries": self.entries,
            "counts": {mtrace_bin.TYPE_NAMES[t]: self.counts[t] for t in range(1, 9)},
            "bytes_written": self.bytes_written,
        }


def table_path_of(path: str) -> str:
    return stacktable.table_path(path)


# ---------------------------------------------------------------- when to drain


class DrainPacer:
    """How long the recorder sleeps before its next drain of the ring buffer (no --poll-interval).

    Every drain has a fixed cost besides its per-record work: a wakeup into caches other
    processes have taken, the Python calls of a drain, numpy and pyarrow calls per batch. A real
    program's calls arrive at a few 100k a second, so a drain every 10 ms took batches of ~2,500
    records and the fixed cost was ~40 ns a record. The pacer waits until about BATCH records
    are expected (from the rate of the last interval, falling at most by half a drain), at
    least MIN_WAIT_S and at most MAX_WAIT_S (the latency of a recording's end and of its row
    groups), and never longer than a quarter of the ring buffer takes to fill at BURST_RATE,
    so that a burst after a quiet period still fits (BPF never wakes us: BPF_RB_NO_WAKEUP).
    FIXED (seconds): a constant wait instead (--poll-interval)."""

    BATCH = 1 << 16  # records a drain aims for (and at most a quarter of the ring)
    MIN_WAIT_S = 0.001
    MAX_WAIT_S = 0.1
    BURST_RATE = 1e6  # records/s a quiet process may suddenly make (a storm: ~0.75M/s traced)

    def __init__(self, ring_records: int, fixed: float | None = None) -> None:
        self.fixed = fixed
        self.batch = max(1, min(self.BATCH, ring_records // 4))
        self.max_wait = max(self.MIN_WAIT_S, min(self.MAX_WAIT_S, ring_records / 4 / self.BURST_RATE))
        self.rate = 0.0  # records/s expected
        self.last = None  # when the previous drain ended

    def wait(self, drained: int, now: float) -> float:
        """Seconds to sleep after a drain that took DRAINED records and ended at NOW."""
        if self.fixed is not None:
            return self.fixed
        if self.last is not None and now > self.last:
            self.rate = max(drained / (now - self.last), self.rate / 2)
        self.last = now
        if self.rate <= 0:
            return self.max_wait
        return min(self.max_wait, max(self.MIN_WAIT_S, self.batch / self.rate))


# ---------------------------------------------------------------- record --stacks

DIRECT_CHUNK = 8192  # records copied from the ring at a time (640 KiB of samples: the copy stays in the cache)
STACKS_POLL_INTERVAL_S = 0.01  # record --stacks drains this often (DrainPacer's wait otherwise)
STACK_PAGES = 8  # at most 32 KiB of stack copied per allocation (heap's default too)
_ALLOC_TYPES = (
    mtrace_bin.MALLOC,
    mtrace_bin.CALLOC,
    mtrace_bin.REALLOC,
    mtrace_bin.MEMALIGN,
    mtrace_bin.VALLOC,
    mtrace_bin.PVALLOC,
    mtrace_bin.POSIX_MEMALIGN,
)
_MAX_PENDING = 1 << 16  # unmatched stacks (their record was lost) kept before pruning


class StackUnwinder:
    """record --stacks: unwinds each allocation's stack event (ring buffer `stacks`) with its
    process's ProcessImage as it is drained, and labels the records with stack ids.

    BPF copies the registers and stack at the allocating function's return: ip is then the
    return address in its caller and the callee-saved registers hold the caller's values, so
    the unwind starts in the caller; the allocating function itself is added as the leaf
    (libc's symbol), and the caller's pc becomes return address - 1 like every other caller."""

    def __init__(self, libc_path: str) -> None:
        from pymtrace.tracee.unwind import ProcessImages

        self.leaf_files: list[tuple[str, dict[int, int]]] = []  # (real path, {call: pc}), preferred first
        self.processes = ProcessImages()
        self.symbolizer = self.processes.symbolizer
        self.pending: dict[tuple[int, int], tuple[int, tuple, bool]] = {}
        self.missing = 0  # allocation records written with stack id 0
        self.incomplete = 0  # stacks whose unwind did not reach the outermost frame
        self.cpu = 0.0  # CPU time spent taking and unwinding the stack events (the recorder adds it)
        self.event = structs.header("record").structs["stack_event"]
        self.event_size = ctypes.sizeof(self.event)
        self.add_leaf_file(libc_path)
        self.libc_module: dict[tuple[int, int], Any] = {}  # (image, its file count): (Module, {call: pc})

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


# ---------------------------------------------------------------- probes


def probe_libraries(libc_path: str, want_debug: bool = True) -> list[tuple[str, bool]]:
    """[(path, outermost)] to probe: glibc, plus glibc's libc_malloc_debug interposer when it
    is installed next to it and WANT_DEBUG (the process maps or will preload it)."""
    libs = [(libc_path, False)]
    debug = os.path.join(os.path.dirname(libc_path), _DEBUG_LIB)
    if want_debug and os.path.exists(debug) and os.path.realpath(debug) != os.path.realpath(libc_path):
        libs.append((debug, True))
    return libs


def uses_debug_lib(pid: int | None = None, launched: "Launched | None" = None) -> bool:
    """Whether to probe libc_malloc_debug. A launched command: always, since it may exec
    other programs (`env LD_PRELOAD=... prog`, `sh -c`, make) and the loader of the one that
    preloads the debug library maps it and runs the program at once, before pymtrace could
    see it (the probes cost a process that does not map the library nothing). A running
    process: only if it maps it, as each probed function adds BCC detach time at exit."""
    if launched is not None:
        return True
    try:
        return any("libc_malloc_debug" in m.path for m in libc.read_maps(pid))
    except PymtraceError:
        return False


def attach(bpf: Any, libs: list[tuple[str, bool]], pid: int, note_bases: bool = False) -> list[tuple[str, str, tuple]]:
    """Attach every probe. glibc: entry + return probes (free: entry only), return probes
    first so that a thread inside a function during attach cannot leave a stale depth.
    An interposer (libc_malloc_debug): entry probes only (see record.bpf.c).
    Returns [(lib, function, offsets)]."""
    plan = []
    for index, (path, outer) in enumerate(libs):
        seen = set()
        for function in mallocapi.FUNCTIONS:
            func = function.name
            if note_bases and func == "malloc":
                entry = f"enter_malloc_{index}"
            elif outer:
                entry = "enter_outer_" + function.call
            else:
                entry = "enter_" + function.call
            try:
                sym = elf.symbol(path, func)
            except PymtraceError:
                continue
            if sym.address in seen:
                continue
            seen.add(sym.address)
            sites = probesite.sites(path, func)
            offsets = (sites.offset,) + tuple(sites.side_paths)
            plan.append((path, func, sym.address, entry, offsets, function.returns and not outer))
    if not any(p == libs[0][0] for p, *_ in plan):
        raise PymtraceError(f"{libs[0][0]}: no malloc/free symbols to probe (not a libc?)")
    probes = [uprobe(path, addr, "leave", pid, True, func) for path, func, addr, _, _, has_ret in plan if has_ret]
    for path, func, addr, entry, offsets, _has_ret in plan:
        probes += [uprobe(path, addr + off, entry, pid, False, func) for off in offsets]
    uprobes.attach(bpf, probes)
    return [(p, f, o) for p, f, _, _, o, _ in plan]


def attach_foreign(bpf: Any, path: str, family: str, pid: int) -> list[tuple[str, str, tuple]]:
    """Attach the probes of another allocator (FAMILY, a target.allocators.FAMILIES key) in
    PATH: top's placement (allocators.probe_plan), record's programs (enter_f_*, `leave`),
    return probes first. Returns [(path, function, entry offsets)]."""
    plan = allocators.probe_plan(path, family)
    returns, entries = [], []
    for function, probes in plan:
        address = elf.symbol(path, function).address
        for p in probes:
            if p.kind == "return":
                returns.append(uprobe(path, address + p.offset, "leave", pid, True, function))
            elif p.kind == "entry":
                entry = "enter_f_" + p.program.removeprefix("ms_f_")
                entries.append(uprobe(path, address + p.offset, entry, pid, False, function))
    uprobes.attach(bpf, returns + entries)
    return [(path, f, tuple(p.offset for p in probes if p.kind == "entry")) for f, probes in plan]


def foreign_defines(found: libc.Allocator | None, cxx: str | None) -> dict[str, int]:
    """record.bpf.c's switches for its enter_f_* programs: only those attach_foreign will
    attach for the allocator FOUND (None: glibc, probed by the libc's programs) and the C++
    runtime CXX (None: none probed) -- none for a glibc process without C++ (a BCC compile
    costs ~0.02 CPU-s a program). Raises PymtraceError as allocators.probe_plan does."""
    wanted = set()
    if found is not None:
        wanted |= allocators.programs(found.path, found.family)
    if cxx is not None:
        wanted |= allocators.programs(cxx, allocators.CXX_FAMILY)
    names = {"enter_f_" + p.removeprefix("ms_f_") for p in wanted if p != "ms_f_return"}  # `leave`: always
    return {"F_SELECT": 1, **{f"WANT_{name}": 1 for name in sorted(names)}}


# ---------------------------------------------------------------- the recorder


class Recorder:
    """One `pymtrace record` run: ARGS are its parsed arguments, PAGES the ring buffer's size
    in pages (a power of two)."""

    stack_unwinder: StackUnwinder | None = None  # record --stacks (also for Recorders made without __init__)
    allocator: libc.Allocator | None = None

    def __init__(self, args: argparse.Namespace, pages: int) -> None:
        self.args = args
        self.pages = pages
        self.outputs = {}
        self.bpf = None
        self.reader = None
        self.launched = None
        self.follow = args.follow_forks
        self.start = None
        self.alive = set()
        self.procevents = None
        self.consumer_cpu = 0.0  # CPU time spent draining the ring buffer and writing
        self.polls = 0
        self.last_poll = None
        self.max_gap = 0.0
        self.allocator_warned = []  # -- CMD: programs whose malloc cannot be recorded, warned of
        self.probed_files: set[tuple[str, str]] = set()  # (path, family) with probes (-- CMD: per exec)
        self.stacks = getattr(args, "stacks", False)
        self.stack_unwinder: StackUnwinder | None = None
        self.allocator = None  # -p on jemalloc, tcmalloc, ...: its file is probed instead of libc

    @property
    def family(self) -> str:
        """The allocator family recorded ("glibc", or a target.allocators.FAMILIES key)."""
        return self.allocator.family if self.allocator is not None else "glibc"

    # -- files
    def output_for(self, tgid: int) -> Output:
        out = self.outputs.get(tgid)
        if out is not None:
            return out
        if getattr(self.args, "network", None) is not None:  # record --to: see netsink
            return self._network_output(tgid)
        if tgid == self.target:
            if self.args.output:
                path, fd = self.args.output, open_exclusive(self.args.output, self.args.force)
            else:
                suffix = ".parquet" if self.args.format == "parquet" else ""
                path, fd = open_unique(f"mtrace.out.{tgid}{suffix}")
        else:
            base = f"{self.outputs[self.target].path}.{tgid}"
            try:
                path, fd = open_unique(base)
            except PymtraceError as exc:  # a full disk: stop like a failed write
                raise WriteFailed(str(exc)) from None
        meta = self._parquet_metadata(tgid) if self.args.format == "parquet" else None
        if self.stacks and meta is not None:
            meta["pymtrace.stacks"] = os.path.basename(stacktable.table_path(path))
        table_fd = None
        if self.stacks:
            try:
                table_fd = open_exclusive(stacktable.table_path(path), self.args.force)
            except PymtraceError:
                os.close(fd)
                os.unlink(path)
                raise
        out = Output(
            path,
            fd,
            self.args.format,
            tgid,
            fallback_maps=self._note_bases,
            metadata=meta,
            stacks=self.stacks,
            allocator=self.family,
        )
        if table_fd is not None:
            out.stack_table = stacktable.TableWriter(table_fd, path, tgid, self.stack_unwinder.symbolizer.frames)
        self.outputs[tgid] = out
        out.snapshot_maps()
        if not self.args.quiet and not self.args.json:
            print(f"pymtrace: writing to {path}", file=sys.stderr)
        return out

    def _network_output(self, tgid: int) -> Output:
        """Process TGID's records streamed to a collector (record --to), with the metadata a
        local Parquet recording would have."""
        from pymtrace.net.sender import NetOutput

        address, config, memory, send_timeout = self.args.network
        meta = self._parquet_metadata(tgid)
        out = NetOutput(address, config, tgid, meta, memory, quiet=self.args.quiet, close_wait=send_timeout)
        self.outputs[tgid] = out
        if not self.args.quiet and not self.args.json:
            print(f"pymtrace: streaming process {tgid} to the collector at {out.path}", file=sys.stderr)
        return out

    def _parquet_metadata(self, tgid: int) -> dict[str, str]:
        """The Parquet key-value metadata of process TGID's recording (docs/formats.md)."""
        from pymtrace.trace.formats import parquet

        libc_path = getattr(self, "libc_path", None)
        return parquet.file_metadata(
            pid=tgid,
            magic_thread=tgid,
            comm=proc.comm(tgid) or None,
            host=os.uname().nodename,
            libc_path=libc_path,
            libc_build_id=elf.build_id(libc_path) if libc_path else None,
            page_size=_PAGE,
            start_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            start_time_ns=time.time_ns(),
            start_monotonic_ns=time.monotonic_ns(),
            command=" ".join(self.args.cmd) if tgid == self.target and self.args.cmd else None,
            byteorder=sys.byteorder,
            source_format="record",
            allocator=self.family,
            allocator_path=self.allocator.path if self.allocator is not None else libc_path,
        )

    def run(self) -> int:
        """Record until the target exits, --duration or a stop signal; the exit status."""
        args = self.args
        if args.cmd and args.cmd[0] == "--":
            args.cmd = args.cmd[1:]
        if args.pid is None and not args.cmd:
            raise PymtraceError("give -p PID or -- CMD ARGS...")
        if args.pid is not None and args.cmd:
            raise PymtraceError("give either -p PID or -- CMD, not both")
        if self.stacks and args.format == "mtrace-text":
            raise PymtraceError(
                "--stacks needs --format mtrace-bin or parquet (a text log has no field for a stack id)"
            )
        bpfload.require_root("pymtrace record")
        if args.cmd:
            from pymtrace.tracee.launch import Launched

            self.launched = Launched(args.cmd)
            self.target = self.launched.pid
            # its objects mapped (LD_PRELOAD too), nothing run yet: resolved as for -p
            self.launched.run_until_loaded()
            libc_path = args.libc or libc.process_libc(self.target) or self.launched.libc_path()
            found = None if args.libc else libc.allocator(self.target)
            if found is not None and found.family not in (None, "glibc"):
                self.allocator = found  # named by the trace; probed beside glibc (_probe_program)
        else:
            self.target = proc.tgid(args.pid)  # a thread id means its whole process
            if self.target == os.getpid():
                raise PymtraceError(
                    f"process {self.target} is this pymtrace: recording it would record its own recording without end"
                )
            libc_path = args.libc or libc.process_libc(self.target)
            found = None if args.libc else libc.allocator(self.target)
            if found is not None and not found.traced:
                if found.family is None:
                    raise PymtraceError(libc.untraced_message(self.target, found) + ": nothing to record")
                self.allocator = found  # jemalloc, tcmalloc, mimalloc, a malloc of its own
        self.libc_path = libc_path
        try:
            if libc_path is None:
                raise PymtraceError(
                    "the process does not use a shared libc (static binary?): nothing to probe; use --libc PATH"
                )
            if self.stacks:
                self.stack_unwinder = StackUnwinder(libc_path)
                if self.allocator is not None:  # its functions are the leaf where it is mapped
                    self.stack_unwinder.add_leaf_file(self.allocator.path)
                if self.launched is None:
                    self.stack_unwinder.capture(self.target)
            self.output_for(self.target)
            try:
                self._load(libc_path)
            except BaseException:
                self._discard_outputs()  # nothing was recorded: leave no empty trace behind
                raise
            return self._loop()
        finally:
            self._cleanup()

    def _discard_outputs(self):
        for out in self.outputs.values():
            if out.fd is None:  # record --to: no file, stop its sender
                out.discard()
                continue
            if getattr(out, "stack_table", None) is not None:
                try:
                    os.close(out.stack_table.fd)
                    os.unlink(stacktable.table_path(out.path))
                except OSError:
                    pass
            for fd in (out.fd, getattr(out, "final_fd", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            try:
                os.unlink(out.path)
            except OSError:
                pass
        self.outputs.clear()

    def _load(self, libc_path: str) -> None:
        defines = {"RB_PAGES": self.pages, "PAGE_SIZE_BYTES": _PAGE, "TARGET_TGID": self.target}
        if self.follow:
            defines["FOLLOW"] = 1
        if self.launched is not None:  # it may exec onto another allocator (_probe_program)
            defines["EXEC_ALLOCATORS"] = 1
        if self.stacks:
            from pymtrace.sources.heap import possible_cpus

            defines.update(STACKS=1, STACK_PAGES=STACK_PAGES, STACK_RB_PAGES=self.pages, MAX_CPUS=possible_cpus())
        # -p on another allocator: its functions only (target.allocators), no chunk headers;
        # -- CMD: glibc's, and per program (it may exec) its allocator's beside (_probe_program)
        found = self.allocator if self.launched is None else None
        if found is not None:
            defines["GLIBC_CHUNKS"] = 0
            defines["LIBC_PROBES"] = 0
            defines["OUTER_PROBES"] = 0
            self.libs = [(found.path, False)]
            probed = found.path
        else:
            if not os.path.isfile(libc_path):
                raise PymtraceError(f"{libc_path}: no such file")
            want_debug = self.follow or uses_debug_lib(
                pid=None if self.launched is not None else self.target, launched=self.launched
            )
            self.libs = probe_libraries(libc_path, want_debug)
            defines["OUTER_PROBES"] = int(any(outer for _, outer in self.libs))  # only the programs it attaches
            if self.args.format == "mtrace-text":
                defines["NOTE_BASES"] = 1
                for index, (path, _) in enumerate(self.libs):
                    defines[f"MALLOC_SITE_{index}"] = f"{probesite.entry_site(path, 'malloc'):#x}ULL"
            skips = probesite.tcache_shutdown_returns(libc_path)
            if len(skips) == 2:
                site = probesite.entry_site(libc_path, "free")
                defines["FREE_SKIP1"] = f"{skips[0] - site:#x}ULL"
                defines["FREE_SKIP2"] = f"{skips[1] - site:#x}ULL"
            probed = libc_path
        # C++'s operator new/delete where the process's calls resolve (-p: known now; a
        # launched command: per program, _probe_program)
        cxx = libc.cxx_runtime(self.target) if self.launched is None else None
        if self.launched is None:  # a launched command may exec onto any allocator: all enter_f_*
            defines.update(foreign_defines(found, cxx))
        self.bpf = bpfload.load("record", defines=defines, what="pymtrace record")
        if self.stacks:
            self.bpf["stacks"].open_ring_buffer(self.stack_unwinder.on_event)
        if self.follow:
            self.bpf["traced"][ctypes.c_uint32(self.target)] = ctypes.c_uint32(1)
            self._start_procevents()
        pid = -1 if self.follow else self.target
        try:
            if found is not None:
                self.sites = attach_foreign(self.bpf, found.path, found.family, pid)
            else:
                self.sites = attach(self.bpf, self.libs, pid, note_bases=self.args.format == "mtrace-text")
        except Exception as exc:  # BCC's attach_uprobe raises plain Exception; reported below
            if isinstance(exc, PymtraceError):
                raise
            if not proc.exists(self.target):
                raise ProcessGone(self.target) from None
            raise PymtraceError(f"cannot attach uprobes to {probed}: {exc}") from None
        if found is not None:
            self.probed_files.add((found.path, found.family))
        if self.launched is not None:  # its allocator and operator new, as they resolve now
            self._probe_program(self.target, at_start=True)
        if cxx is not None:
            try:
                self.sites += attach_foreign(self.bpf, cxx, allocators.CXX_FAMILY, pid)
            except PymtraceError:
                raise
            except Exception as exc:  # BCC's attach_uprobe raises plain Exception
                if not proc.exists(self.target):
                    raise ProcessGone(self.target) from None
                raise PymtraceError(f"cannot attach uprobes to {cxx}: {exc}") from None
        self.bpf["enabled"][ctypes.c_int(0)] = ctypes.c_uint32(1)
        sample = ctypes.sizeof(structs.header("record").structs["record_event"])
        self.reader = RingReader(self.bpf["events"].map_fd, self.pages * _PAGE, sample, mtrace_bin.RECORD_SIZE)
        self.sample = sample

    def _start_procevents(self):
        self.alive = {self.target}
        try:
            from pymtrace.tracee.procevents import ProcEvents

            self.procevents = ProcEvents(kinds=("fork", "exit")).start()
        except (PymtraceError, OSError):
            self.procevents = None  # fall back to scanning /proc for children

    def _drain(self, final: bool = False) -> int:
        total = 0
        now = time.monotonic()
        if self.last_poll is not None:
            self.max_gap = max(self.max_gap, now - self.last_poll)
        self.last_poll = now
        t0 = time.thread_time()
        # Only what was reserved when this drain began (the final drain: when stopping
        # began): a process whose calls our own draining causes (pymtrace's own writes
        # reaching a traced reader...) can never keep a drain, or the stop, going.
        limit = self.reader.producer()
        if self.stack_unwinder is not None:
            # every record reserved before `limit` had its stack committed before it
            t1 = time.thread_time()
            self.bpf.ring_buffer_consume()
            self.stack_unwinder.cpu += time.thread_time() - t1
        patience = time.monotonic() + 0.1
        # a parquet file of one process: the records go from the ring straight into the columns
        args = getattr(self, "args", None)  # (tests drive Recorders made without __init__)
        direct = (
            getattr(args, "format", None) == "parquet"
            and self.stack_unwinder is None
            and not self.follow
            and getattr(args, "network", None) is None
        )
        # a stop signal waits until this drain is done: a batch taken from the ring is
        # always written whole, and the counts match the file
        try:
            with stopping.stop_deferred():
                # Take what is there and go back to sleep: chasing the producer in a loop
                # would read tiny batches, and the per-batch cost would dominate. Read again
                # at once only while batches are large (the buffer was filling up).
                while True:
                    if direct:
                        n = self._drain_words(limit)
                    else:  # a chunk at a time: its copy and write(2) stay in the cache
                        data, n = self.reader.read(max_records=DIRECT_CHUNK, limit=limit)
                    if not n:
                        if final and self.reader.cons_pos[0] < limit and time.monotonic() < patience:
                            time.sleep(0.001)  # a record reserved before the stop, being written
                            continue
                        return total
                    total += n
                    if not direct:
                        self._dispatch(data, n)
                        if n == DIRECT_CHUNK:
                            continue
                    if n < self.reader.max_batch // 8 and not final:
                        return total
        finally:
            self.consumer_cpu += time.thread_time() - t0
            self.polls += 1

    def _drain_words(self, limit: int) -> int:
        """Copy the committed records from the ring into the target's parquet columns (one
        copy, no bytes object in between), DIRECT_CHUNK at a time: a chunk's header check
        brings its records into the cache the copy then reads (a whole large batch would not
        fit). How many."""
        total = 0
        while True:
            words, n = self.reader.read_words(limit=limit, max_records=DIRECT_CHUNK)
            if not n:
                return total
            try:
                self.output_for(self.target).write_words(words[:, 1:9])
            finally:
                del words  # the ring's mmap cannot close while a view of it lives
                self.reader.consume(n)
            total += n
            if n < DIRECT_CHUNK:
                return total

    def _dispatch(self, data: tuple[bytes | bytearray, list[int] | numpy.ndarray | None], n: int) -> None:
        recs, tg = data
        rs = mtrace_bin.RECORD_SIZE
        if self.stack_unwinder is not None:
            recs = self.stack_unwinder.label(recs, n, tg, self.target, self.output_for)
        if tg is None:
            self.output_for(self.target).write(recs, n)
            return
        first = int(tg[0])
        numpy = not isinstance(tg, list)  # the reader copies with numpy when it is installed
        if (numpy and bool((tg == first).all())) or (not numpy and tg.count(first) == n):
            self.output_for(first).write(recs, n)
            return
        # several processes in this batch (--follow-forks): split into runs
        tgids = tg.tolist() if numpy else tg
        i = 0
        while i < n:
            j = i
            t = tgids[i]
            while j < n and tgids[j] == t:
                j += 1
            self.output_for(t).write(recs[i * rs : j * rs], j - i)
            i = j

    def _lost(self):
        return int(self.bpf["lost"].sum(ctypes.c_int(0)).value)

    def _retried(self):
        try:
            return int(self.bpf["retried"].sum(ctypes.c_int(0)).value)
        except KeyError:  # a program without the counter
            return 0

    def _target_alive(self, pidfd: int) -> bool:
        if self.launched is not None:
            if self.launched.held:
                at_exit = self.stack_unwinder.at_exit if self.stack_unwinder is not None else None
                return self.launched.service(at_exit) is None
            if self.launched.proc.poll() is not None:
                return False
        else:
            r, _, _ = select.select([pidfd], [], [], 0)
            if r:
                return False
        return True

    def _children_alive(self):
        if not self.follow:
            return False
        if self.procevents is not None:
            for ev in self.procevents.drain():
                if ev.kind == "fork" and ev.pid == ev.tgid and ev.parent_tgid in self.alive:
                    self.alive.add(ev.tgid)
                elif ev.kind == "exit" and ev.pid == ev.tgid:
                    self.alive.discard(ev.tgid)
        self.alive |= set(self.outputs)
        self.alive = {p for p in self.alive if p != self.target and proc.exists(p)}
        return bool(self.alive)

    def _loop(self):
        args = self.args
        if args.poll_interval is not None:
            fixed = max(args.poll_interval, 0.5) / 1000.0
        else:  # --stacks: its stack events fill their ring ~100 times faster: the old 10 ms
            fixed = STACKS_POLL_INTERVAL_S if self.stacks else None
        pacer = DrainPacer(self.reader.max_batch, fixed)
        pidfd = os.pidfd_open(self.target)
        self.start = time.monotonic()
        deadline = self.start + args.duration if args.duration else None
        if self.launched is not None:
            # --stacks: held at its exit, so the libraries it loaded are read before they go
            # held at each exec (its new allocator probed) and, with --stacks, at its exit
            self.launched.resume(hold_exit=self.stacks, on_exec=self._probe_program)
        if not args.quiet and not args.json:
            what = " ".join(args.cmd) if args.cmd else f"process {self.target}"
            print(f"pymtrace: recording {what}" + ("" if args.duration else "; Ctrl-C to stop"), file=sys.stderr)
        interrupted = False
        last_maps = 0.0
        self.failure = None
        try:
            while True:
                drained = self._drain()
                if args.format == "parquet":
                    t0 = time.thread_time()
                    for out in list(self.outputs.values()):
                        out.poll()
                    self.consumer_cpu += time.thread_time() - t0
                now = time.monotonic()
                if args.format == "mtrace-text" and now - last_maps > 0.2:
                    for out in self.outputs.values():
                        out.snapshot_maps()
                    last_maps = now
                if deadline is not None and now >= deadline:
                    break
                if not self._target_alive(pidfd) and not self._children_alive():
                    break
                timeout = pacer.wait(drained, now)
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - now))
                time.sleep(timeout)
        except KeyboardInterrupt:
            interrupted = True
        except WriteFailed as exc:  # disk full: what was written whole stays, recording stops
            self.failure = exc
        finally:
            os.close(pidfd)
            stopping.begin_stopping()  # from here on SIGINT/SIGTERM cannot cut the stop short
        # a last drain: everything committed before we stop (later SIGINT/SIGTERM are
        # ignored while stopping, see pymtrace.cli)
        if self.failure is None:
            try:
                self._drain(final=True)
            except WriteFailed as exc:
                self.failure = exc
        self.duration = time.monotonic() - self.start
        self.interrupted = interrupted
        return self._finish()

    def _probe_program(self, pid: int, at_start: bool = False) -> None:
        """-- CMD, stopped with its program's objects mapped (at start and after each exec,
        target.launch): probe where its malloc-API and operator new calls resolve (the same
        resolution as -p: libc.allocator, libc.cxx_runtime) unless probed already; the trace
        names that allocator. What cannot be probed is warned of once, never fatal here."""
        try:
            found = None if self.args.libc else libc.allocator(pid)
            cxx = libc.cxx_runtime(pid)
        except PymtraceError:  # gone meanwhile: its end is seen by the loop
            return
        wanted = []
        if found is not None and found.family not in (None, "glibc"):
            wanted.append((found.path, found.family))
        if cxx is not None:
            wanted.append((cxx, allocators.CXX_FAMILY))
        where = -1 if self.follow else self.target
        for path, family in wanted:
            if (path, family) in self.probed_files:
                continue
            self.probed_files.add((path, family))
            try:
                self.sites += attach_foreign(self.bpf, path, family, where)
            except PymtraceError as exc:
                if at_start:
                    raise
                print(f"pymtrace: warning: {exc}", file=sys.stderr)
            except Exception as exc:  # BCC's attach_uprobe raises plain Exception
                if at_start:
                    raise PymtraceError(f"cannot attach uprobes to {path}: {exc}") from None
                print(f"pymtrace: warning: cannot attach uprobes to {path}: {exc}", file=sys.stderr)
        if found is None:
            return
        foreign = found.family not in (None, "glibc")
        self.bpf["foreign"][ctypes.c_int(0)] = ctypes.c_uint32(int(foreign))
        if found.family is None and found not in self.allocator_warned:
            self.allocator_warned.append(found)
            print(f"pymtrace: warning: {libc.untraced_message(pid, found)}", file=sys.stderr)
        elif found.family is not None:
            if foreign and self.stack_unwinder is not None:
                self.stack_unwinder.add_leaf_file(found.path)
            if at_start:
                return
            self.allocator = found if foreign else None  # the trace names the last program's
            for out in self.outputs.values():
                if hasattr(out, "set_allocator"):
                    out.set_allocator(self.family, found.path)

    def _finish(self):
        args = self.args
        lost = self._lost()
        if self.reader is not None:
            lost += self.reader.discarded
        stacks_lost = n_stacks = stacks_unsent = 0
        if self.stack_unwinder is not None:
            tables = [o.stack_table for o in self.outputs.values() if o.stack_table is not None]
            stacks_lost = self.stack_unwinder.missing + sum(t.overflow for t in tables)
            n_stacks = sum(len(t.ids) for t in tables)
            stacks_unsent = int(self.bpf["stack_lost"].sum(ctypes.c_int(0)).value)
        t0 = time.thread_time()  # closing writes what is buffered (parquet: the last row group)
        self.failure = self.failure or close_outputs(list(self.outputs.values()))
        self.consumer_cpu += time.thread_time() - t0
        summary = {
            "files": [o.summary() for o in self.outputs.values()],
            "entries": sum(o.entries for o in self.outputs.values()),
            "lost": lost,
            "duration_s": round(self.duration, 3),
            "bytes_written": sum(o.bytes_written for o in self.outputs.values()),
            "buffer_size": self.pages * _PAGE,
            "consumer_cpu_s": round(self.consumer_cpu, 6),
            "polls": self.polls,
            "max_poll_gap_s": round(self.max_gap, 4),
            "reserve_retries": self._retried(),
            "max_backlog_bytes": self.reader.max_backlog if self.reader is not None else 0,
        }
        if self.stack_unwinder is not None:
            summary["stacks"] = n_stacks
            summary["stacks_lost"] = stacks_lost  # allocation records with stack id 0
            summary["stacks_not_copied"] = stacks_unsent  # in BPF: ring full or scratch slot reused
            summary["stacks_incomplete"] = self.stack_unwinder.incomplete
            summary["unwinder_cpu_s"] = round(self.stack_unwinder.cpu, 6)
        if self.failure is not None:
            summary["error"] = str(self.failure)
        if self.launched is not None:
            # a held command's stops must be taken by service() (Popen.poll would swallow one)
            at_exit = self.stack_unwinder.at_exit if self.stack_unwinder is not None else None
            rc = self.launched.service(at_exit)
            summary["command_exit_status"] = rc
        if args.json:
            print(json.dumps(summary), file=sys.stderr)
        else:
            for o in summary["files"]:
                print(f"pymtrace: {o['entries']} entries recorded in {o['file']}", file=sys.stderr)
                counts = ", ".join(f"{k} {v}" for k, v in o["counts"].items() if v)
                print(f"pymtrace:   {counts or 'no calls'}; {o['bytes_written']} bytes written", file=sys.stderr)
            print(f"pymtrace: {lost} events lost, {summary['duration_s']:.3f} s", file=sys.stderr)
            if self.stack_unwinder is not None:
                print(
                    f"pymtrace: {summary['stacks']} distinct stacks in {len(self.outputs)} stack table(s); "
                    f"{stacks_lost} allocations without a stack (id 0)",
                    file=sys.stderr,
                )
            if lost:
                print(
                    "pymtrace: events were lost: the ring buffer was full; use a larger --buffer-size"
                    + ("" if args.allow_drops else " (or --allow-drops)"),
                    file=sys.stderr,
                )
        if self.failure is not None:
            raise WriteFailed(
                f"{self.failure}; recording stopped, {summary['entries']} complete "
                f"entries kept" + (f" in {len(self.outputs)} files" if len(self.outputs) > 1 else "")
            )
        if (lost or stacks_lost) and not args.allow_drops:
            return EXIT_LOST
        return 0

    def _note_bases(self, out: Output) -> None:
        """Library load addresses seen by BPF, for a process that exited before /proc was read."""
        try:
            items = list(self.bpf["bases"].items())
        except KeyError:  # the map exists only with NOTE_BASES (mtrace-text)
            return
        for key, base in items:
            tgid, index = key.value >> 32, key.value & 0xFFFFFFFF
            if tgid != out.tgid or index >= len(self.libs):
                continue
            path = self.libs[index][0]
            end = base.value + elf.image_size(path)
            out.resolver.add_maps([libc.Mapping(base.value, end, "r-xp", 0, 0, path)], prefer=False)

    def _cleanup(self):
        if self.procevents is not None:
            self.procevents.stop()
        if self.launched is not None and not self.launched.resumed:
            self.launched.kill()  # failed before it could run traced: do not let it run
        elif self.launched is not None:
            self.launched.release()  # still running (Ctrl-C, --duration): on, untraced
        # a launched command still running after Ctrl-C/--duration keeps running, untraced
        if self.reader is not None:
            try:
                self.reader.close()
            except (BufferError, OSError, ValueError):  # a view still exported: the process exit frees it
                pass
        uprobes.detach(self.bpf)
