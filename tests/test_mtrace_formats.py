"""Readers of both trace formats: round trips, clear errors, and fuzzing (never crash or hang)."""
import io
import struct

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_pymtrace
from pymtrace.errors import CorruptFile
from pymtrace.formats import mtrace_bin as B
from pymtrace.formats import mtrace_text as T

MAGIC = B.magic_record()


def recs():
    return [
        B.Record(10, B.MALLOC, 0, 0x1000, 16, 0, 32, ts_ns=5, caller=0x401000),
        B.Record(10, B.CALLOC, 0, 0x2000, 32, 0, 48),
        B.Record(11, B.REALLOC, 0x1000, 0x3000, 64, 32, 80),
        B.Record(11, B.REALLOC, 0, 0x4000, 8, 0, 32),  # realloc(NULL, n)
        B.Record(11, B.REALLOC, 0x4000, 0, 0, 32, 0),  # realloc(p, 0)
        B.Record(11, B.REALLOC, 0x3000, 0, 1 << 62, 80, 0),  # failed realloc
        B.Record(10, B.FREE, 0, 0, 0, 0, 0),  # free(NULL)
        B.Record(10, B.FREE, 0x2000, 0, 0, 48, 0),
        B.Record(10, B.POSIX_MEMALIGN, 22, 0, 100, 3, 0),  # EINVAL
        B.Record(10, B.POSIX_MEMALIGN, 0, 0x5000, 48, 32, 64),
        B.Record(10, B.MALLOC, 0, 0, 1 << 40, 0, 0),  # failed
        B.Record(10, B.VALLOC, 0, 0x6000, 10, 4096, 32, path=1 << 4),
    ]


def test_bin_round_trip_and_zero_records_skipped():
    data = MAGIC + b"\0" * 64 + b"".join(B.pack(r) for r in recs()) + b"\0" * 128
    assert list(B.iter_records(io.BytesIO(data))) == recs()


def test_bin_big_endian_and_wrong_files():
    big = B.magic_record(byteorder=">") + B.pack(recs()[0], ">")
    assert list(B.iter_records(io.BytesIO(big))) == recs()[:1]
    with pytest.raises(CorruptFile, match="empty"):
        list(B.iter_records(io.BytesIO(b"")))
    with pytest.raises(CorruptFile, match="MAGIC"):
        list(B.iter_records(io.BytesIO(b"= Start\n" + b"x" * 100)))
    with pytest.raises(CorruptFile, match="truncated"):
        list(B.iter_records(io.BytesIO(MAGIC + B.pack(recs()[0])[:40])))
    with pytest.raises(CorruptFile, match="32-bit"):
        list(B.iter_records(io.BytesIO(struct.pack("<iIII", 1, 255, 0x1234, 4) + b"\0" * 48)))
    bad = bytearray(B.pack(recs()[0]))
    bad[4] = 77
    with pytest.raises(CorruptFile, match="byte 64 has unknown call type 77"):
        list(B.iter_records(io.BytesIO(MAGIC + bytes(bad))))


class Trickle(io.RawIOBase):
    """A pipe-like stream returning at most 7 bytes a read."""

    def __init__(self, data):
        self.data = data

    def readable(self):
        return True

    def read(self, n=-1):
        k = 7 if n is None or n < 0 else min(7, n)
        chunk, self.data = self.data[:k], self.data[k:]
        return chunk


def test_bin_short_reads_are_not_truncation():
    data = MAGIC + b"".join(B.pack(r) for r in recs())
    assert list(B.iter_records(Trickle(data))) == recs()


def test_text_lines_match_glibc():
    lines = []
    for r in recs():
        lines += T.record_lines(r, "/bin/x:[0x10]" if r.caller else "")
    assert lines == [
        "@ /bin/x:[0x10] + 0x1000 0x10", "+ 0x2000 0x20", "< 0x1000", "> 0x3000 0x40", "+ 0x4000 0x8",
        "- 0x4000", "! 0x3000 0x4000000000000000", "- 0x2000", "+ 0x5000 0x30",
        "+ (nil) 0x10000000000", "+ 0x6000 0xa",
    ]
    out = io.StringIO()
    T.write(recs(), out)
    events = T.parse(out.getvalue())
    assert [e.op for e in events] == ["+", "+", "<", ">", "+", "-", "!", "-", "+", "+", "+", "="]
    back = list(T.to_records(events))
    assert [(r.type, r.ptr1, r.ptr2) for r in back][:4] == [(1, 0, 0x1000), (1, 0, 0x2000), (4, 0x1000, 0x3000), (1, 0, 0x4000)]
    assert set(T.leaks(events)) == {0x3000, 0x5000, 0x6000}


def test_text_errors():
    with pytest.raises(CorruptFile, match="= Start"):
        T.parse(b"hello\n")
    with pytest.raises(CorruptFile, match="line 2"):
        T.parse(b"= Start\n+ 0x10\n")
    with pytest.raises(CorruptFile, match="non-ASCII"):
        T.parse(b"= Start\n\xff\n")
    with pytest.raises(CorruptFile, match="not followed"):
        list(T.to_records(T.parse(b"= Start\n< 0x10\n")))


def test_caller_resolver():
    from pymtrace.libc import parse_maps_text

    maps = parse_maps_text(
        "555555554000-555555555000 r--p 00000000 fe:00 1 /usr/bin/prog\n"
        "555555555000-555555556000 r-xp 00001000 fe:00 1 /usr/bin/prog\n"
        "7ffff7dd0000-7ffff7df0000 rw-p 00000000 00:00 0\n")
    r = T.CallerResolver()
    r.add_maps(maps)
    assert r(0x555555555123) == "/usr/bin/prog:[0x1123]"
    assert r(0x7ffff7dd0010) == "[0x7ffff7dd0010]"
    assert r(0) == ""


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=1000))
def test_fuzz_bin_reader(data):
    for prefix in (b"", MAGIC):
        try:
            for _ in B.iter_records(io.BytesIO(prefix + data)):
                pass
        except CorruptFile:
            pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([MAGIC, b"\0" * 64] + [B.pack(r) for r in recs()]), max_size=8),
       st.integers(0, 511), st.integers(0, 255))
def test_fuzz_bin_reader_mutated(parts, pos, byte):
    data = bytearray(MAGIC + b"".join(parts))
    data[pos % len(data)] = byte
    try:
        for r in B.iter_records(io.BytesIO(bytes(data))):
            assert r.type in B.TYPE_NAMES
    except CorruptFile:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_text_reader(data):
    for prefix in (b"", b"= Start\n"):
        try:
            list(T.to_records(T.parse(prefix + data)))
        except CorruptFile:
            pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="@+-<>!=()x0123456789abcdefnil :[]/.\n Start End", max_size=40), max_size=10))
def test_fuzz_text_reader_near_valid(lines):
    data = "= Start\n" + "\n".join(lines)
    try:
        list(T.to_records(T.parse(data)))
    except CorruptFile:
        pass


def test_dump_and_convert_cli(tmp_path):
    src = tmp_path / "t.bin"
    src.write_bytes(MAGIC + b"".join(B.pack(r) for r in recs()))
    p = run_pymtrace("dump", "--json", src, check=True)
    import json

    doc = json.loads(p.stdout)
    assert doc["stats"]["records"] == len(recs())
    assert doc["stats"]["types"]["malloc"] == {"count": 2, "requested_bytes": 16 + (1 << 40), "failed": 1,
                                                "min_size": 16, "max_size": 1 << 40}
    assert doc["stats"]["free_null"] == 1
    assert doc["records"][2]["call"] == "realloc"
    txt = tmp_path / "t.txt"
    run_pymtrace("convert", src, txt, "--to", "mtrace-text", check=True)
    assert txt.read_text().splitlines()[1] == "@ [0x401000] + 0x1000 0x10"
    back = tmp_path / "back.bin"
    run_pymtrace("convert", txt, back, "--to", "mtrace-bin", check=True)
    assert len(list(B.read_file(back))) == 10
    again = run_pymtrace("convert", src, txt, "--to", "mtrace-text")
    assert again.returncode != 0 and "exists" in again.stderr
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01" * 100)
    p = run_pymtrace("dump", bad)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "MAGIC" in p.stderr
