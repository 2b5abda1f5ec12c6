"""The ring-buffer consumer of `pymtrace record` on a fake ring with the kernel's layout, and
the recorder's output files (no BPF)."""

import mmap
import os
import queue
import struct
import types

import pytest

from pymtrace.bpf import ringbuf
from pymtrace.commands import record
from pymtrace.errors import PymtraceError, WriteFailed
from pymtrace.recorder import drain, inprocess, outputs
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.tracee import probesite
from pymtrace.tracee.procevents import ProcEvent

PAGE = mmap.PAGESIZE
SIZE = 4 * PAGE
SAMPLE = 72
STRIDE = 80


class FakeRing(ringbuf.RingReader):
    """Same memory layout as the kernel's mapping: consumer page, producer page, data twice."""

    def __init__(self):
        self.size, self.mask, self.sample, self.stride = SIZE, SIZE - 1, SAMPLE, STRIDE
        self.record_size = B.RECORD_SIZE
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
            self.data[0:tail] = blob[STRIDE - tail :]
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
        monkeypatch.setattr(ringbuf, "_np", None)
    elif ringbuf._np is None:
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
    with pytest.raises(PymtraceError):
        record.parse_size("lots")


def test_tcache_shutdown_sites_found_in_system_libc():
    from pymtrace.tracee import elf, libc

    path = libc.system_libc()
    sites = probesite.tcache_shutdown_returns(path)
    free = elf.symbol(path, "free")
    # glibc 2.26+: two calls (the cached blocks, then the cache itself), near each other
    assert len(sites) == 2 and 0 < sites[1] - sites[0] < 0x100
    assert all(abs(s - free.address) < 0x10000 for s in sites)


def test_read_stops_at_the_limit_taken_when_stopping(ring):
    """The final drain reads only what was reserved when stopping began: records produced
    after (e.g. caused by the drain itself) cannot keep it going."""
    for i in range(5):
        ring.produce(rec(i), 7)
    limit = ring.producer()
    for i in range(5, 9):
        ring.produce(rec(i), 7)
    data, n = ring.read(limit=limit)
    assert n == 5 and [r.size for r in decode(data[0])] == list(range(5))
    assert ring.read(limit=limit) == (None, 0)
    data, n = ring.read()
    assert n == 4


EVERY_KIND = [
    B.Record(1, B.MALLOC, 0, 0x1000, 24, 0, 32, 1, 0x401000),
    B.Record(1, B.MALLOC, 0, 0, 1 << 62, 0, 0, 2, 0x401000),  # failed malloc
    B.Record(1, B.CALLOC, 0, 0x2000, 0, 0, 32, 3, 0x401010),  # calloc(0)
    B.Record(1, B.FREE, 0x1000, 0, 0, 32, 0, 4, 0x401020),
    B.Record(1, B.FREE, 0, 0, 0, 0, 0, 5, 0x401020),  # free(NULL): no line
    B.Record(1, B.REALLOC, 0, 0x3000, 40, 0, 48, 6, 0),  # realloc(NULL, n)
    B.Record(1, B.REALLOC, 0x3000, 0x4000, 400, 48, 416, 7, 0x7F0000001000),
    B.Record(1, B.REALLOC, 0x4000, 0, 0, 416, 0, 8, 0x401030),  # realloc(p, 0)
    B.Record(1, B.REALLOC, 0x2000, 0, 1 << 62, 32, 0, 9, 0x401030),  # failed realloc
    B.Record(1, B.MEMALIGN, 0, 0x5000, 64, 128, 80, 10, 0x401040),
    B.Record(1, B.VALLOC, 0, 0x6000, 10, 4096, 32, 11, 0x401040),
    B.Record(1, B.PVALLOC, 0, 0x7000, 10, 0, 4112, 12, 0x401040),
    B.Record(1, B.POSIX_MEMALIGN, 0, 0x8000, 40, 32, 48, 13, 0x401050),
    B.Record(1, B.POSIX_MEMALIGN, 22, 0, 40, 3, 0, 14, 0x401050),  # EINVAL: no line
]


def _records_bytes(records):
    return b"".join(B.pack(r) for r in records)


def test_text_output_streams_the_lines_glibc_writes(tmp_path):
    """mtrace-text is written as it is recorded, line for line what formats.mtrace_text
    writes for the same records (callers resolved through the process's maps)."""
    import io

    from pymtrace.trace.formats import mtrace_text as T
    from pymtrace.tracee import libc

    path = tmp_path / "t.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    out = outputs.Output(str(path), fd, "mtrace-text", 999999999)
    maps = [libc.Mapping(0x400000, 0x402000, "r-xp", 0, 1, "/usr/bin/prog")]
    out.resolver.add_maps(maps)
    out.write(_records_bytes(EVERY_KIND[:7]), 7)
    out.write(_records_bytes(EVERY_KIND[7:]), len(EVERY_KIND) - 7)
    out.close()
    resolver = T.CallerResolver()
    resolver.add_maps(maps)
    expect = io.StringIO()
    T.write(EVERY_KIND, expect, resolver)
    assert path.read_text() == expect.getvalue()
    assert out.entries == len(EVERY_KIND) and out.bytes_written == len(expect.getvalue())


@pytest.mark.parametrize("fmt", ["mtrace-bin", "mtrace-text"])
def test_failed_write_keeps_whole_records_only(tmp_path, monkeypatch, fmt):
    """A write that stops half way (the disk filled up): the file is cut back to its last
    complete record, the count says how many, and WriteFailed names the error."""
    import errno

    path = tmp_path / "t"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    out = outputs.Output(str(path), fd, fmt, 999999999)
    out.write(_records_bytes(EVERY_KIND[:3]), 3)
    whole = path.read_bytes()
    real_write = os.write
    budget = [100]  # bytes left on the "disk"

    def full(f, data):
        if f != fd:
            return real_write(f, data)
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        k = real_write(f, bytes(data[: budget[0]]))
        budget[0] -= k
        return k

    monkeypatch.setattr(outputs.os, "write", full)
    with pytest.raises(WriteFailed, match=r"^cannot write .*: No space left on device$"):
        out.write(_records_bytes(EVERY_KIND[3:]), len(EVERY_KIND) - 3)
    monkeypatch.undo()
    data = path.read_bytes()
    assert data.startswith(whole) and len(data) <= len(whole) + 100
    if fmt == "mtrace-bin":
        assert len(data) % 64 == 0 and out.entries == len(data) // 64 - 1
    else:
        assert data.endswith(b"\n")
        kept_lines = data[len(whole) :].decode().splitlines()
        # FREE(p), free(NULL), realloc(NULL,n), then a moving realloc's two lines, whole or not at all
        assert kept_lines[:2] == ["@ [0x401020] - 0x1000", "+ 0x3000 0x28"]
        assert len(kept_lines) in (2, 4)
        assert out.entries == 3 + (3 if len(kept_lines) == 2 else 4)
    assert out.bytes_written == len(data)
    out.close()


def test_final_drain_ends_although_draining_makes_records(ring):
    """A traced process whose every drained batch makes it produce more records (pymtrace
    itself, a reader of the trace): the last drain takes what was reserved when stopping
    began, and ends."""
    got = []

    class Writer:
        def write(self, data, n):
            got.extend(r.size for r in decode(data))
            assert len(got) < 1000, "the drain chases its own records"
            ring.produce(rec(len(got) + 100), 7)  # the drain's own write makes a new record

    drainer = drain.Drainer(ring, lambda tgid: Writer(), target=7)
    for i in range(10):
        ring.produce(rec(i), 7)
    assert drainer.drain(final=True) == 10
    assert got == list(range(10))


def test_direct_drain_copies_in_chunks_across_wraparound(monkeypatch):
    """record --format parquet: the records go from the ring into the columns DIRECT_CHUNK at a
    time, all of them, in order, across the ring's end; a busy sample stops the drain. (numpy:
    a declared dependency, which read_words needs; no memoryview variant.)"""
    ring = FakeRing()
    monkeypatch.setattr(drain, "DIRECT_CHUNK", 16)
    got = []

    class Columns:
        def write_words(self, words):
            got.extend(int(w) for w in words[:, 2])  # ptr2

    drainer = drain.Drainer(ring, lambda tgid: Columns(), target=7, direct=True)
    for round_ in range(5):  # 5 x 150 samples through a ring of ~204
        for i in range(150):
            ring.produce(rec(round_ * 150 + i), 7)
        assert drainer.drain_words(ring.producer()) == 150
    assert got == [rec(i).ptr2 for i in range(750)]
    offs = [ring.produce(rec(750 + i), 7) for i in range(40)]
    ring.set_flags(offs[20], 1 << 31)  # still being written
    assert drainer.drain_words(ring.producer()) == 20
    ring.set_flags(offs[20], 0)
    assert drainer.drain_words(ring.producer()) == 20
    assert got == [rec(i).ptr2 for i in range(790)]


def test_drain_pacer_waits_for_a_large_batch_within_bounds():
    pacer = drain.DrainPacer(ring_records=419_430)  # 32 MiB of 80-byte samples
    assert pacer.batch == 1 << 16 and pacer.max_wait == 0.1
    assert pacer.wait(0, 10.0) == 0.1  # nothing seen yet: the longest wait
    assert pacer.wait(250_000, 11.0) == 0.1  # 250k/s: the batch in 0.26 s, capped
    assert pacer.wait(2_000_000, 12.0) == pytest.approx(65_536 / 2e6)  # a burst: sooner
    assert pacer.wait(0, 12.1) == pytest.approx(65_536 / 1e6)  # quiet again: the rate halves a drain
    assert pacer.wait(0, 12.2) == 0.1  # 500k/s: 0.13 s, capped
    small = drain.DrainPacer(ring_records=3276)  # 256 KiB: a quarter of it fills in 0.8 ms at 1M/s
    assert small.batch == 819 and small.wait(0, 1.0) == drain.DrainPacer.MIN_WAIT_S
    assert drain.DrainPacer(419_430, fixed=0.05).wait(10**6, 1.0) == 0.05  # --poll-interval 50


def _exec_watched(target):
    """record's ExecWatched of TARGET, fed events by the test (no cn_proc socket)."""
    watched = inprocess.ExecWatched(target=target, launched=None, follow=True)
    watched.procevents = types.SimpleNamespace(queue=queue.Queue(), dropped=0)  # (ProcEvents' own)
    return watched


def test_a_childs_exec_is_told_when_its_fork_comes_after_the_last_poll():
    """A followed child's fork and exec can both arrive between a poll's drain and the
    next take of the execs: the exec is still told, and an unrelated process's is not."""
    watched = _exec_watched(1)
    me, other = os.getpid(), os.getppid()
    watched._seen(ProcEvent("fork", me, me, 1, None, 0.0))
    watched._seen(ProcEvent("exec", me, me, None, None, 0.0))
    watched._seen(ProcEvent("exec", other, other, None, None, 0.0))  # not a child of the target
    (told,) = watched.take_execs()
    assert told[0] == me and told[2] == os.path.realpath(f"/proc/{me}/exe") and told[3] == os.geteuid()
    assert watched.take_execs() == []


def test_an_exec_is_told_when_the_execs_are_taken_while_it_is_read(monkeypatch):
    """The drain takes the execs while the events' thread reads an exec's /proc entries (its
    I/O lets the other thread run): that exec is told at the next take, not lost."""
    watched = _exec_watched(os.getpid())
    taken = []
    real_uid = inprocess.proc.effective_uid

    def uid_read_while_the_drain_takes(pid):
        taken.extend(watched.take_execs())  # (the drain's thread, in the middle of the read)
        return real_uid(pid)

    monkeypatch.setattr(inprocess.proc, "effective_uid", uid_read_while_the_drain_takes)
    me = os.getpid()
    watched._seen(ProcEvent("exec", me, me, None, None, 0.0))
    assert taken == [] and [e[0] for e in watched.take_execs()] == [me]
