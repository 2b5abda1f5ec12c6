"""Convert a binary call trace into a .wl replay workload (the library of `pymtrace workload`).

Reads a `pymtrace record` trace or an upstream dj/malloc mtrace.out (`-` = stdin) and writes
the .wl format that `pymtrace replay` and upstream trace_run read (docs/formats.md, section 3).

The algorithm is upstream trace2wl's: every address gets a pointer index, each address has an
owner thread, and a thread touching an address owned by another gets a SYNC_R matched by a
SYNC_W in the owner's stream at that point; a new thread's stream starts with a SYNC_R matched
in the first thread's stream. Deliberate differences (off with --upstream-compat, which
reproduces upstream's bytes, defects included):

* threads are told apart by their whole TID (upstream hashes TID>>3 and merges TIDs that
  differ only in the low 3 bits), addresses by their whole value (upstream: ptr>>3);
* ALLOC_SYNCS is m+1 for sync ids 1..m (upstream writes m: trace_run's arrays are one short);
* posix_memalign and realloc results take part in cross-thread ordering (upstream: neither);
* inversions (an allocation returning an address whose free is recorded later) are queued
  per address, any number deep, for every allocating call including memalign,
  posix_memalign and realloc; whatever is still queued at the end is reported record by
  record (upstream repairs one level for malloc/calloc/valloc/pvalloc only and overwrites);
* a failed realloc(p, n>0) leaves p allocated (upstream forgets p); invalid frees are
  reported and emit nothing, not even a sync; posix_memalign's return code is not an address;
* memory is bounded (see BOUND below) instead of keeping every address ever seen.

BOUND: per-thread streams are spooled to one temporary file (16 KiB buffered per thread),
so memory is O(live pointers + pending inversions + threads + min(freed addresses,
--freed-cache)). Freed addresses are remembered (for the cross-thread ordering of their
reuse and for index reuse) up to --freed-cache entries; the oldest is then forgotten and its
pointer index goes back to its last owner thread, which alone may reuse it -- that keeps
index reuse race-free without extra syncs. Forgetting only drops a SYNC that ordered an
address's reuse after its free in another thread (replay slots differ, so nothing breaks).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, BinaryIO

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace.files import atomic_output
from pymtrace.trace.formats import mtrace_bin as mb
from pymtrace.trace.formats import wl

if TYPE_CHECKING:
    from tqdm import tqdm

FLUSH_BYTES = 16384
_SMALL = [wl.encode_varint(v) for v in range(1 << 14)]


def _v(value: int) -> bytes:
    """encode_varint with the common small values precomputed."""
    return _SMALL[value] if value < 16384 else wl.encode_varint(value)


DEFAULT_FREED_CACHE = 1 << 18

_ALLOC_OP = {
    mb.MALLOC: wl.MALLOC,
    mb.CALLOC: wl.CALLOC,
    mb.VALLOC: wl.VALLOC,
    mb.PVALLOC: wl.PVALLOC,
}


class _Thread:
    __slots__ = ("tid", "started", "buf", "chunks", "total", "free_idx", "index")

    def __init__(self, tid: int, index: int) -> None:
        self.tid = tid
        self.index = index
        self.started = False
        self.buf = bytearray()
        self.chunks = []  # (offset, length) in the spool file
        self.total = 0
        self.free_idx = []


class _Addr:
    __slots__ = ("ptr", "idx", "owner", "valid", "reason", "pending", "size")

    def __init__(self, ptr: int, idx: int) -> None:
        self.ptr = ptr
        self.idx = idx
        self.owner: _Thread | None = None
        self.valid = False
        self.reason: tuple[int, int | str] | None = None  # (record number, what) of the last change
        self.pending: list[tuple[mb.Record, int]] | None = None  # deferred records (inversions), FIFO
        self.size = 0  # requested bytes while valid


class Converter:
    """Feed Records in trace order, then finish(outfile)."""

    def __init__(
        self,
        compat: bool = False,
        freed_cache: int = DEFAULT_FREED_CACHE,
        tmpdir: str | None = None,
        warn: Callable[[str], None] | None = None,
        max_warnings: int = 20,
        valloc_as_memalign: bool = False,
    ):
        self.compat = compat
        self.valloc_as_memalign = valloc_as_memalign
        self.freed_cache = max(1, freed_cache)
        self.spool = tempfile.TemporaryFile(dir=tmpdir, prefix="pymtrace-wl-")
        self.spool_size = 0
        self.threads = {}
        self.addrs = {}
        self.freed = {}  # key -> None, insertion-ordered: forgettable freed addresses
        self.next_idx = 2 if not compat else 1  # default: index 1 stays reserved like upstream's MAGIC slot
        self.syncs = 0
        self.master = None
        self.recno = 0
        self.warn = warn or (lambda msg: print(f"pymtrace workload: {msg}", file=sys.stderr))
        self.max_warnings = max_warnings
        self.stats = dict(
            records=0,
            inversions_fixed=0,
            inversions_unrepaired=0,
            invalid_frees=0,
            null_results=0,
            unknown_reallocs=0,
            forgotten_addresses=0,
        )
        self._tcounts = {}
        self.live_bytes = self.peak_bytes = 0  # requested bytes of live blocks, in trace order

    @property
    def counts(self) -> dict[str, int]:
        """Calls per type name in the trace."""
        return {mb.TYPE_NAMES.get(t, f"type{t}"): n for t, n in self._tcounts.items()}

    # -- helpers -----------------------------------------------------------------------
    def _warning(self, msg: str) -> None:
        n = self.stats["inversions_unrepaired"] + self.stats["invalid_frees"]
        if n <= self.max_warnings:
            self.warn(msg)

    def _thread(self, tid: int) -> _Thread:
        key = (tid & 0xFFFFFFFFFFFFFFFF) >> 3 if self.compat else tid
        t = self.threads.get(key)
        if t is None:
            t = self.threads[key] = _Thread(tid, len(self.threads))
        return t

    def _emit(self, t: _Thread, data: bytes) -> None:
        t.buf += data
        if len(t.buf) >= FLUSH_BYTES:
            self._flush(t)

    def _flush(self, t: _Thread) -> None:
        if t.buf:
            self.spool.seek(self.spool_size)
            self.spool.write(t.buf)
            t.chunks.append((self.spool_size, len(t.buf)))
            self.spool_size += len(t.buf)
            t.total += len(t.buf)
            t.buf = bytearray()

    def _sync(self, rel: _Thread, acq: _Thread) -> None:
        if rel is acq:
            return
        self.syncs += 1
        v = _v(self.syncs)
        self._emit(rel, bytes((wl.SYNC_W,)) + v)
        self._emit(acq, bytes((wl.SYNC_R,)) + v)

    def _acq(self, t: _Thread, a: _Addr | None) -> None:
        if a is None:
            return
        if a.owner is not None and a.owner is not t:
            self._sync(a.owner, t)
        a.owner = t

    def _addr(self, ptr: int, t: _Thread | None) -> _Addr | None:
        if ptr == 0:
            return None
        key = ptr >> 3 if self.compat else ptr
        a = self.addrs.get(key)
        if a is None:
            if t is not None and t.free_idx:
                idx = t.free_idx.pop()
            else:
                idx = self.next_idx
                self.next_idx += 1
            a = self.addrs[key] = _Addr(ptr, idx)
            if not self.compat:
                self._forgettable(key)
        return a

    def _forgettable(self, key: int) -> None:
        self.freed[key] = None

    def _evict(self) -> None:
        """Forget the oldest freed addresses beyond --freed-cache (only between records, so
        no _Addr is in use); the index goes to the last owner thread's free list."""
        while len(self.freed) > self.freed_cache:
            old = next(iter(self.freed))
            del self.freed[old]
            a = self.addrs.get(old)
            if a is None or a.valid or a.pending:
                continue
            del self.addrs[old]
            self.stats["forgotten_addresses"] += 1
            if a.owner is not None:
                a.owner.free_idx.append(a.idx)
            # an address no thread ever touched keeps its index unused (harmless)

    @staticmethod
    def _what(reason: tuple[int, int | str]) -> int | str:
        what = reason[1]
        return mb.TYPE_NAMES.get(what, what) if isinstance(what, int) else what

    def _set_valid(self, a: _Addr, recno: int, what: int | str, size: int = 0) -> None:
        if a.valid:
            self.live_bytes -= a.size
        self.live_bytes += size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        a.size = size
        a.valid = True
        a.reason = (recno, what)
        if not self.compat:
            self.freed.pop(a.ptr, None)

    def _set_invalid(self, a: _Addr, recno: int, what: str) -> None:
        if a.valid:
            self.live_bytes -= a.size
        a.valid = False
        a.reason = (recno, what)
        if not self.compat and not a.pending:
            self._forgettable(a.ptr)

    def _defer(self, a: _Addr, rec: mb.Record, recno: int) -> None:
        if self.compat:
            if a.pending:
                self._warning(
                    f"record {recno}: pointer {a.ptr:#x} alloc'd again? (possible multi-level inversion) "
                    f"size {rec.size}; upstream overwrites the earlier inversion"
                )
            a.pending = [(rec, recno)]
        else:
            if a.pending is None:
                a.pending = []
            a.pending.append((rec, recno))
        self.stats["inversions_fixed"] += 1

    # -- the conversion ----------------------------------------------------------------
    def set_magic_thread(self, tid: int) -> None:
        """Upstream processes the MAGIC record like a call: its thread becomes the master
        thread and its ptr1 0x1234 takes pointer index 1. Only --upstream-compat copies that."""
        if self.compat:
            t = self._thread(tid)
            self.master = t
            t.started = True
            self._addr(mb.MAGIC_PTR, t)

    def feed(self, rec: mb.Record) -> None:
        """Convert one record (in trace order)."""
        self.recno += 1
        tc = self._tcounts
        tc[rec.type] = tc.get(rec.type, 0) + 1
        if len(self.freed) > self.freed_cache:
            self._evict()
        self._process(rec, self.recno)

    def feed_all(self, records: Iterable[mb.Record]) -> None:
        """feed() for an iterable, with the common case (malloc/free of a known thread) inlined."""
        if self.compat:
            for rec in records:
                self.feed(rec)
            return
        tc = self._tcounts
        freed, addrs, threads = self.freed, self.addrs, self.threads
        process = self._process
        MALLOC, FREE = mb.MALLOC, mb.FREE
        for rec in records:
            self.recno += 1
            typ = rec.type
            tc[typ] = tc.get(typ, 0) + 1
            if len(freed) > self.freed_cache:
                self._evict()
            t = threads.get(rec.thread)
            if t is None or not t.started:
                process(rec, self.recno)
                continue
            if typ == MALLOC and rec.ptr2:
                a = addrs.get(rec.ptr2)
                if a is not None and (a.valid or (a.owner is not None and a.owner is not t)):
                    process(rec, self.recno)  # inversion or a sync: the general path
                    continue
                if a is None:
                    a = self._addr(rec.ptr2, t)
                a.owner = t
                buf = t.buf
                buf.append(2)
                buf += _v(a.idx)
                buf += _v(rec.size)
                a.valid = True
                a.size = rec.size
                self.live_bytes += rec.size
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
                a.reason = (self.recno, MALLOC)
                freed.pop(rec.ptr2, None)
                if len(buf) >= FLUSH_BYTES:
                    self._flush(t)
            elif typ == FREE and rec.ptr1:
                a = addrs.get(rec.ptr1)
                if a is None or not a.valid or a.owner is not t or a.pending:
                    process(rec, self.recno)
                    continue
                buf = t.buf
                buf.append(5)
                buf += _v(a.idx)
                a.valid = False
                self.live_bytes -= a.size
                a.reason = (self.recno, "free")
                freed[rec.ptr1] = None
                if len(buf) >= FLUSH_BYTES:
                    self._flush(t)
            else:
                process(rec, self.recno)

    def _process(self, rec: mb.Record, recno: int) -> None:
        t = self._thread(rec.thread)
        if self.master is None:
            self.master = t
            t.started = True
        elif not t.started:
            self._sync(self.master, t)
            t.started = True
        typ = rec.type
        compat = self.compat
        if compat:
            pa1 = self._addr(rec.ptr1, t)
            pa2 = self._addr(rec.ptr2, t)
        else:
            pa1 = self._addr(rec.ptr1, t) if typ in (mb.FREE, mb.REALLOC) else None
            pa2 = self._addr(rec.ptr2, t) if typ != mb.FREE else None

        if typ in _ALLOC_OP or (not compat and typ in (mb.MEMALIGN, mb.POSIX_MEMALIGN)):
            if typ == mb.POSIX_MEMALIGN and rec.ptr1 != 0:
                pa2 = None  # failed: nothing allocated
            if pa2 is not None and pa2.valid:
                self._defer(pa2, rec, recno)
                return
            self._acq(t, pa2)
            if pa2 is None:
                self.stats["null_results"] += 1
            if typ in (mb.VALLOC, mb.PVALLOC) and self.valloc_as_memalign:
                # upstream trace_run aborts on VALLOC/PVALLOC: the same request as a MEMALIGN
                page = rec.size2 if typ == mb.VALLOC and rec.size2 and not rec.size2 & (rec.size2 - 1) else 4096
                size = rec.size if typ == mb.VALLOC else max(page, (rec.size + page - 1) // page * page)
                self._emit(t, bytes((wl.MEMALIGN,)) + _v(pa2.idx if pa2 else 0) + _v(page) + _v(size))
            elif typ in _ALLOC_OP:
                self._emit(t, bytes((_ALLOC_OP[typ],)) + _v(pa2.idx if pa2 else 0) + _v(rec.size))
            else:
                self._emit(t, bytes((wl.MEMALIGN,)) + _v(pa2.idx if pa2 else 0) + _v(rec.size2) + _v(rec.size))
            if pa2 is not None:
                self._set_valid(pa2, recno, typ, rec.size)
        elif typ == mb.MEMALIGN:  # compat
            self._acq(t, pa2)
            if pa2 is not None and pa2.valid:
                self._warning(f"record {recno}: pointer {pa2.ptr:#x} memalign'd again?")
            self._emit(t, bytes((wl.MEMALIGN,)) + _v(pa2.idx if pa2 else 0) + _v(rec.size2) + _v(rec.size))
            if pa2 is not None:
                self._set_valid(pa2, recno, "memalign", rec.size)
        elif typ == mb.POSIX_MEMALIGN:  # compat: no cross-thread ordering
            ok = rec.ptr1 == 0 and pa2 is not None
            self._emit(t, bytes((wl.MEMALIGN,)) + _v(pa2.idx if ok else 0) + _v(rec.size2) + _v(rec.size))
            if ok:
                self._set_valid(pa2, recno, "posix_memalign", rec.size)
        elif typ == mb.FREE:
            if compat:
                self._acq(t, pa1)
            if pa1 is None:
                self._emit(t, b"\x05\x00")
            elif pa1.valid:
                self._acq(t, pa1)
                self._emit(t, bytes((wl.FREE,)) + _v(pa1.idx))
                self._set_invalid(pa1, recno, "free")
                self._released(pa1)
            else:
                self.stats["invalid_frees"] += 1
                why = f"{self._what(pa1.reason)} at record {pa1.reason[0]}" if pa1.reason else "never allocated"
                self._warning(f"record {recno}: invalid free({pa1.ptr:#x}) by thread {rec.thread}: {why}; skipped")
        elif typ == mb.REALLOC:
            self._realloc(t, rec, recno, pa1, pa2)

    def _realloc(self, t: _Thread, rec: mb.Record, recno: int, pa1: _Addr | None, pa2: _Addr | None) -> None:
        if self.compat:
            if pa1 is not None and pa1.owner is not None:
                self._acq(t, pa1)
            if pa2 is not None and pa2.owner is not None:
                self._acq(t, pa2)
            self._emit(t, bytes((wl.REALLOC,)) + _v(pa2.idx if pa2 else 0) + _v(pa1.idx if pa1 else 0) + _v(rec.size))
            if pa1 is not None:
                if pa1.valid:
                    self.live_bytes -= pa1.size
                pa1.valid = False
                pa1.reason = (recno, "realloc'd away")
            if pa2 is not None:
                self._set_valid(pa2, recno, "realloc", rec.size)
            return
        if pa2 is not None and pa2 is not pa1 and pa2.valid:
            self._defer(pa2, rec, recno)
            return
        if pa1 is not None and not pa1.valid:
            self.stats["unknown_reallocs"] += 1
        self._acq(t, pa1)
        self._acq(t, pa2)
        if pa2 is None and rec.size:
            self.stats["null_results"] += 1
        self._emit(t, bytes((wl.REALLOC,)) + _v(pa2.idx if pa2 else 0) + _v(pa1.idx if pa1 else 0) + _v(rec.size))
        failed = pa2 is None and rec.size != 0
        if pa1 is not None and pa1 is not pa2 and not failed:
            self._set_invalid(pa1, recno, "realloc'd away")
        if pa2 is not None:
            self._set_valid(pa2, recno, "realloc", rec.size)
        if pa1 is not None and pa1 is not pa2 and not failed:
            self._released(pa1)

    def _released(self, a: _Addr) -> None:
        """An address was freed: replay the allocations that were recorded too early."""
        work = [a]
        while work:
            x = work.pop()
            if x.valid or not x.pending:
                continue
            rec, recno = x.pending.pop(0)
            self._process(rec, recno)  # a deferred realloc calls _released for its old pointer
            if x.pending:
                work.append(x)
            elif not self.compat and not x.valid:
                self._forgettable(x.ptr)

    def finish(self, out: BinaryIO) -> dict[str, int]:
        """Report unrepaired inversions, then write the .wl to the binary file object OUT."""
        for a in list(self.addrs.values()):
            for rec, recno in a.pending or ():
                self.stats["inversions_unrepaired"] += 1
                self._warning(
                    f"record {recno}: thread {rec.thread} {rec.type_name} -> {a.ptr:#x} not replayed: the address "
                    f"was still allocated ({self._what(a.reason)} at record {a.reason[0]}) and is never freed before the "
                    f"end of the trace (unrepaired inversion)"
                )
        self.stats["records"] = self.recno
        self.stats["inversions_fixed"] -= self.stats["inversions_unrepaired"]
        threads = sorted(self.threads.values(), key=lambda t: (t.tid & 0xFFFFFFFFFFFFFFFF) >> (3 if self.compat else 0))
        for t in threads:
            t.buf += bytes((wl.DONE,))
            t.total += len(t.buf)
        nsyncs = self.syncs if self.compat else self.syncs + 1
        header = wl.header_bytes(self.next_idx, nsyncs, [t.total for t in threads])
        out.write(header)
        for t in threads:
            for off, n in t.chunks:
                self.spool.seek(off)
                remaining = n
                while remaining:
                    chunk = self.spool.read(min(remaining, 1 << 20))
                    out.write(chunk)
                    remaining -= len(chunk)
            out.write(t.buf)
        self.spool.close()
        self.stats.update(
            ideal_rss_bytes=self.peak_bytes,
            threads=len(threads),
            syncs=self.syncs,
            pointer_slots=self.next_idx,
            bytes=len(header) + sum(t.total for t in threads),
        )
        return self.stats


class _Counting:
    """A binary stream wrapper that replays peeked bytes and reports progress."""

    def __init__(self, stream: BinaryIO, prefix: bytes, progress: tqdm | None) -> None:
        self.stream = stream
        self.prefix = prefix
        self.progress = progress

    def read(self, n: int = -1) -> bytes:
        if self.prefix:
            data, self.prefix = self.prefix[:n], self.prefix[n:]
            if len(data) < n:
                data += self.stream.read(n - len(data))
        else:
            data = self.stream.read(n)
        if self.progress is not None and data:
            self.progress.update(len(data))
        return data


def _progress_bar(total: int | None, mode: str) -> tqdm | None:
    if mode == "never" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        width = 0
    # a terminal that reports 0 columns (a fresh pty) would make tqdm draw an empty bar
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="converting",
        file=sys.stderr,
        leave=False,
        mininterval=0.5,
        ncols=None if width > 0 else 80,
    )


def convert_stream(
    stream: BinaryIO,
    out: BinaryIO,
    name: str = "trace",
    compat: bool = False,
    freed_cache: int = DEFAULT_FREED_CACHE,
    tmpdir: str | None = None,
    total: int | None = None,
    progress: str = "never",
    warn: Callable[[str], None] | None = None,
    max_warnings: int = 20,
    valloc_as_memalign: bool = False,
) -> tuple[dict[str, int], dict[str, int]]:
    """Convert a binary trace stream (mtrace-bin, or a Parquet file) into .wl bytes written
    to OUT; returns (stats, counts)."""
    first = stream.read(mb.RECORD_SIZE)
    path = getattr(stream, "name", None)
    if first[:4] == b"PAR1" and isinstance(path, str) and os.path.isfile(path):
        return _convert_parquet(path, out, name, compat, freed_cache, tmpdir, warn, max_warnings, valloc_as_memalign)
    try:
        order = mb.detect_byteorder(first)
    except CorruptFile as exc:
        raise CorruptFile(f"{name}: {exc}") from None
    magic_tid = int.from_bytes(first[:4], "little" if order == "<" else "big", signed=True)
    conv = Converter(compat, freed_cache, tmpdir, warn, max_warnings, valloc_as_memalign)
    conv.set_magic_thread(magic_tid)
    bar = _progress_bar(total, progress)
    try:
        if bar is not None:
            bar.update(len(first))
        conv.feed_all(mb.iter_records(_Counting(stream, first, bar), name=name))
    finally:
        if bar is not None:
            bar.close()
    stats = conv.finish(out)
    return stats, conv.counts


def _convert_parquet(
    path: str,
    out: BinaryIO,
    name: str,
    compat: bool,
    freed_cache: int,
    tmpdir: str | None,
    warn: Callable[[str], None] | None,
    max_warnings: int,
    valloc_as_memalign: bool,
) -> tuple[dict[str, int], dict[str, int]]:
    """convert_stream for a Parquet recording: the rows, the MAGIC thread from its metadata."""
    from pymtrace.trace.formats import parquet  # pyarrow: imported only when needed

    parquet.open_file(path)
    _, magic_tid = parquet.magic_of(parquet.read_metadata(path))
    conv = Converter(compat, freed_cache, tmpdir, warn, max_warnings, valloc_as_memalign)
    conv.set_magic_thread(magic_tid)
    conv.feed_all(parquet.iter_records(path))
    stats = conv.finish(out)
    return stats, conv.counts


def convert_file(src: str, dst: str, force: bool = False, **kw) -> tuple[dict[str, int], dict[str, int]]:
    """Convert trace file SRC ('-' = stdin) into .wl file DST ('-' = stdout; an existing DST is
    refused unless FORCE)."""
    if src == "-":
        stream, total, name = sys.stdin.buffer, None, "<stdin>"
    else:
        try:
            stream = open(src, "rb")
        except OSError as exc:
            raise PymtraceError(f"cannot read {src}: {exc.strerror}") from None
        total, name = os.fstat(stream.fileno()).st_size, src
    try:
        if dst == "-":
            return convert_stream(stream, sys.stdout.buffer, name=name, total=total, **kw)
        with atomic_output(dst, force) as out:
            return convert_stream(stream, out, name=name, total=total, **kw)
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
