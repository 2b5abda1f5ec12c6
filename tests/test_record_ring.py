"""The ring-buffer consumer of `pymtrace record` on a fake ring with the kernel's layout (no BPF)."""
import mmap
import struct

import pytest

from pymtrace import record
from pymtrace.formats import mtrace_bin as B

PAGE = mmap.PAGESIZE
SIZE = 4 * PAGE
SAMPLE = 72
STRIDE = 80


class FakeRing(record.RingReader):
    """Same memory layout as the kernel's mapping: consumer page, producer page, data twice."""

    def __init__(self):
        self.size, self.mask, self.sample, self.stride = SIZE, SIZE - 1, SAMPLE, STRIDE
        self.cons_map = mmap.mmap(-1, PAGE)
        self.prod_map = mmap.mmap(-1, PAGE + 2 * SIZE)
        self.cons_pos = memoryview(self.cons_map).cast("Q")
        self.prod_pos = memoryview(self.prod_map)[:8].cast("Q")
        self.data = memoryview(self.prod_map)[PAGE:]
        self.words = self.data.cast("Q")
        self.max_batch = SIZE // STRIDE
        self.discarded = 0
        self.max_backlog = 0
        self.prod = 0

    def produce(self, rec, tgid, flags=0):
        sample = B.pack(rec) + struct.pack("<Q", tgid)
        hdr = struct.pack("<II", SAMPLE | flags, 0)
        blob = hdr + sample
        off = self.prod & self.mask
        for base in (off, off + SIZE):  # the data pages are mapped twice in a row
            end = min(base + STRIDE, 2 * SIZE)
            self.data[base:end] = blob[: end - base]
        if off + STRIDE > SIZE:  # the wrapped tail also lands at the start of the first copy
            tail = off + STRIDE - SIZE
            self.data[0:tail] = blob[STRIDE - tail:]
        self.prod += STRIDE
        struct.pack_into("<Q", self.prod_map, 0, self.prod)
        return off

    def set_flags(self, off, flags):
        for base in (off, off + SIZE):
            if base + 4 <= 2 * SIZE:
                struct.pack_into("<I", self.data, base, SAMPLE | flags)


@pytest.fixture(params=["numpy", "memoryview"])
def ring(request, monkeypatch):
    if request.param == "memoryview":
        monkeypatch.setattr(record, "_np", None)
    elif record._np is None:
        pytest.skip("numpy not installed")
    return FakeRing()


def rec(i):
    return B.Record(100 + i % 3, B.MALLOC, 0, 0x1000 + i * 16, i, 0, 32, ts_ns=i + 1, caller=0x400000 + i)


def decode(recs):
    return list(B.iter_records(__import__("io").BytesIO(B.magic_record() + bytes(recs))))


def test_reads_in_order_across_wraparound(ring):
    got = []
    for round_ in range(5):  # 5 x 150 samples through a ring of ~204: wraps several times
        for i in range(150):
            ring.produce(rec(round_ * 150 + i), 7)
        (recs, tg), n = ring.read()
        assert n == 150
        assert list(tg) == [7] * 150
        got += decode(recs)
    assert got == [rec(i) for i in range(750)]
    assert ring.read() == (None, 0)


def test_stops_at_busy_and_skips_discarded(ring):
    offs = [ring.produce(rec(i), 1 + (i >= 3)) for i in range(6)]
    ring.set_flags(offs[4], 1 << 31)  # still being written
    ring.set_flags(offs[1], 1 << 30)  # discarded
    (recs, tg), n = ring.read()
    assert n == 1 and decode(recs) == [rec(0)]
    (recs, tg), n = ring.read()  # the discarded sample is skipped
    assert n == 2 and decode(recs) == [rec(2), rec(3)] and list(tg) == [1, 2]
    assert ring.discarded == 1
    assert ring.read() == (None, 0)  # sample 4 is busy: nothing past it
    ring.set_flags(offs[4], 0)
    (recs, tg), n = ring.read()
    assert decode(recs) == [rec(4), rec(5)]


def test_parse_size():
    assert record.parse_size("64M") * PAGE == 64 << 20
    assert record.parse_size("100K") * PAGE == 128 << 10  # rounded up to a power of two
    with pytest.raises(record.PymtraceError):
        record.parse_size("lots")


def test_tcache_shutdown_sites_found_in_system_libc():
    from pymtrace import libc

    path = libc.system_libc()
    sites = record.tcache_shutdown_returns(path)
    free = libc.symbol(path, "free")
    # glibc 2.26+: two calls (the cached blocks, then the cache itself), near each other
    assert len(sites) == 2 and 0 < sites[1] - sites[0] < 0x100
    assert all(abs(s - free.address) < 0x10000 for s in sites)
