"""Consumer of a BPF ring buffer of fixed-size samples that maps its pages itself.

No per-event callback: every read copies all committed samples out of the ring with a few
strided copies (one vectorised copy with numpy), so a reader pays per batch, not per event.
"""

from __future__ import annotations

import mmap

from pymtrace.errors import PymtraceError

try:  # optional: one vectorised copy per batch instead of one strided copy per word
    import numpy as _np
except ImportError:  # pragma: no cover - the memoryview path does the same, ~2x slower
    _np = None

_PAGE = mmap.PAGESIZE


class RingReader:
    """Consumer of a BPF ring buffer of fixed-size samples, reading its mmap'ed pages directly.

    Kernel layout: page 0 = consumer position (we write it), page 1 = producer position,
    then the data pages mapped twice in a row, so a sample that wraps is contiguous.
    Each sample has an 8-byte header (len | BUSY | DISCARD, page offset). A sample is a
    record of RECORD_SIZE bytes, optionally followed by one u64 (e.g. the process it is from).
    """

    def __init__(self, map_fd: int, size: int, sample_size: int, record_size: int | None = None):
        self.size = size
        self.mask = size - 1
        self.sample = sample_size
        self.record_size = sample_size if record_size is None else record_size
        self.stride = (8 + sample_size + 7) & ~7
        if self.stride % 8 or (sample_size % 8):
            raise ValueError("samples must be a multiple of 8 bytes")
        self.cons_map = mmap.mmap(map_fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod_map = mmap.mmap(map_fd, _PAGE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=_PAGE)
        # positions are read and written as whole aligned 8-byte words (memoryview 'Q' items
        # are copied with one 8-byte memcpy): struct's "<Q" goes byte by byte, and the kernel
        # reading a half-written consumer position sees the ring full and drops records
        self.cons_pos = memoryview(self.cons_map).cast("Q")
        self.prod_pos = memoryview(self.prod_map)[:8].cast("Q")
        self.data = memoryview(self.prod_map)[_PAGE:]
        self.words = self.data.cast("Q")
        self.max_batch = size // self.stride
        self.discarded = 0
        self.max_backlog = 0  # most bytes ever waiting in the ring: how close we came to losing

    def _pos(self):
        return self.cons_pos[0], self.prod_pos[0]

    def producer(self) -> int:
        """The producer position: everything reserved before now lies below it."""
        return self.prod_pos[0]

    def read(self, max_records: int | None = None, limit: int | None = None) -> tuple[object, int]:
        """((records, u64s) of the committed samples, count), or (None, 0) when there are none;
        advances the consumer position. Records: their first record_size bytes, concatenated;
        u64s: the u64 after each record (a list, or a numpy array), None if there is none.
        LIMIT: a producer position read earlier; samples reserved after it are left alone."""
        cons, n = self._committed(max_records, limit)
        if not n:
            return None, 0
        out = self._extract(cons & self.mask, n)
        self._advance(cons + n * self.stride)
        return out, n

    def read_words(self, limit: int | None = None, max_records: int | None = None) -> tuple[object, int]:
        """(an (n, stride/8) uint64 numpy view of the committed samples in the ring itself,
        word 0 the sample header, words 1.. the record), n; or (None, 0). Nothing is copied
        and the consumer position stays: the caller copies what it needs, then calls
        consume(n). One copy less than read() for a consumer that reorganizes the records
        anyway (record --format parquet copies them straight into its columns). At most
        MAX_RECORDS samples. Needs numpy."""
        cons, n = self._committed(max_records, limit)
        if not n:
            return None, 0
        start = _PAGE + (cons & self.mask)
        words = _np.frombuffer(self.prod_map, dtype=_np.uint64, count=n * self.stride // 8, offset=start)
        return words.reshape(n, self.stride // 8), n

    def consume(self, n: int) -> None:
        """Give the N samples read_words() returned back to the kernel."""
        self._advance(self.cons_pos[0] + n * self.stride)

    def _committed(self, max_records: int | None, limit: int | None) -> tuple[int, int]:
        """(consumer position, how many samples from it are committed and readable)."""
        cons, prod = self._pos()
        if prod - cons > self.max_backlog:
            self.max_backlog = prod - cons
        if limit is not None:
            prod = min(prod, limit)
        avail = (prod - cons) // self.stride
        if avail <= 0:
            return cons, 0
        n = min(avail, self.max_batch, max_records or avail)
        off = cons & self.mask
        # stop at the first sample still being written (BUSY) or discarded
        tops = bytes(self.data[off + 3 : off + n * self.stride : self.stride])
        bad = len(tops) - len(tops.lstrip(b"\0"))
        if bad < n:
            if tops[bad] & 0x80:  # BUSY: not committed yet, read up to it
                n = bad
            elif tops[bad] & 0x40:  # DISCARD: skip it (pymtrace never discards; be safe)
                if bad == 0:
                    self.discarded += 1
                    self._advance(cons + self.stride)
                    return self._committed(max_records, limit)
                n = bad
            else:
                raise PymtraceError(f"ring buffer header corrupt at {cons:#x}")
        return cons, n

    def _extract(self, off: int, n: int) -> tuple[bytes | bytearray, list[int] | _np.ndarray | None]:
        """The N samples at data offset OFF, headers dropped: (first record_size bytes of each,
        concatenated; the u64 after them in each sample as a list, or None if the sample is
        only a record). One vectorised copy with numpy, strided word copies without it."""
        rs = self.record_size
        extra = self.sample > rs
        if _np is not None:
            rows = _np.frombuffer(self.prod_map, dtype=_np.uint8, count=n * self.stride, offset=_PAGE + off).reshape(
                n, self.stride
            )
            recs = rows[:, 8 : 8 + rs].tobytes()
            tg = rows[:, 8 + rs : 16 + rs].copy().view("<u8").ravel() if extra else None
            return recs, tg
        qstride = self.stride // 8
        qoff = off // 8 + 1  # skip the 8-byte header
        wpr = rs // 8
        recs = bytearray(n * rs)
        oq = memoryview(recs).cast("Q")
        src = self.words[qoff : qoff + n * qstride]
        for k in range(wpr):
            oq[k::wpr] = src[k::qstride]
        tg = src[wpr::qstride].tolist() if extra else None
        return recs, tg

    def _advance(self, pos: int) -> None:
        self.cons_pos[0] = pos

    def close(self) -> None:
        self.cons_pos.release()
        self.prod_pos.release()
        self.words.release()
        self.data.release()
        self.prod_map.close()
        self.cons_map.close()


class MappedRing:
    """A BPF ring buffer's pages mapped for a consumer that walks variable-length records itself
    (pymtrace heap: tracee.unwind.RingScanner): the addresses and the two positions, no copies.

    data_addr: the data pages, mapped twice in a row as the kernel does (a record that wraps is
    contiguous); size: their length (a power of two). The consumer position is written only by
    advance(), once the caller is done with the records below it."""

    def __init__(self, map_fd: int, size: int) -> None:
        import ctypes

        self.size = size
        self.mask = size - 1
        self.map_fd = map_fd
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._munmap = libc.munmap
        self.cons_map = mmap.mmap(map_fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._length = _PAGE + 2 * size
        addr = libc.mmap(None, self._length, mmap.PROT_READ, mmap.MAP_SHARED, map_fd, _PAGE)
        if addr in (None, ctypes.c_void_p(-1).value):
            self.cons_map.close()
            raise PymtraceError(f"cannot map the ring buffer: errno {ctypes.get_errno()}")
        self._addr = addr
        self.data_addr = addr + _PAGE
        # whole aligned 8-byte words (see RingReader): never a half-written position
        self.cons_pos = memoryview(self.cons_map).cast("Q")
        self.prod_pos = memoryview((ctypes.c_char * 8).from_address(addr)).cast("B").cast("Q")

    def positions(self) -> tuple[int, int]:
        """(consumer, producer) positions."""
        return self.cons_pos[0], self.prod_pos[0]

    def advance(self, pos: int) -> None:
        """Give the records below POS back to the kernel."""
        self.cons_pos[0] = pos

    def close(self) -> None:
        if self._addr is not None:
            self.cons_pos.release()
            self.prod_pos.release()
            self.cons_map.close()
            self._munmap(self._addr, self._length)
            self._addr = None
