"""Readers of both trace formats: round trips, clear errors, and fuzzing (never crash or hang)."""

import io
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cli import run_pymtrace

from pymtrace.errors import CorruptFile
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import mtrace_text as T

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
        "@ /bin/x:[0x10] + 0x1000 0x10",
        "+ 0x2000 0x20",
        "< 0x1000",
        "> 0x3000 0x40",
        "+ 0x4000 0x8",
        "- 0x4000",
        "! 0x3000 0x4000000000000000",
        "- 0x2000",
        "+ 0x5000 0x30",
        "+ (nil) 0x10000000000",
        "+ 0x6000 0xa",
    ]
    out = io.StringIO()
    T.write(recs(), out)
    events = T.parse(out.getvalue())
    assert [e.op for e in events] == ["+", "+", "<", ">", "+", "-", "!", "-", "+", "+", "+", "="]
    back = list(T.to_records(events))
    assert [(r.type, r.ptr1, r.ptr2) for r in back][:4] == [
        (1, 0, 0x1000),
        (1, 0, 0x2000),
        (4, 0x1000, 0x3000),
        (1, 0, 0x4000),
    ]
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
    from pymtrace.tracee.libc import parse_maps_text

    maps = parse_maps_text(
        "555555554000-555555555000 r--p 00000000 fe:00 1 /usr/bin/prog\n"
        "555555555000-555555556000 r-xp 00001000 fe:00 1 /usr/bin/prog\n"
        "7ffff7dd0000-7ffff7df0000 rw-p 00000000 00:00 0\n"
    )
    r = T.CallerResolver()
    r.add_maps(maps)
    assert r(0x555555555123) == "/usr/bin/prog:[0x1123]"
    assert r(0x7FFFF7DD0010) == "[0x7ffff7dd0010]"
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
@given(
    st.lists(st.sampled_from([MAGIC, b"\0" * 64] + [B.pack(r) for r in recs()]), max_size=8),
    st.integers(0, 511),
    st.integers(0, 255),
)
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
    assert doc["stats"]["types"]["malloc"] == {
        "count": 2,
        "requested_bytes": 16 + (1 << 40),
        "failed": 1,
        "min_size": 16,
        "max_size": 1 << 40,
    }
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


@pytest.mark.parametrize(
    "line, command, message",
    [
        (
            "+ 0x1ffffffffffffffff 0x10",
            ["convert", "--to", "mtrace-bin"],
            "line 2: address 0x1ffffffffffffffff does not fit in 64 bits",
        ),
        (
            "+ 0x1000 0x10000000000000000",
            ["convert", "--to", "mtrace-bin"],
            "line 2: size 0x10000000000000000 does not fit",
        ),
        ("@ [0x" + "f" * 40 + "] + 0x1000 0x10", ["convert", "--to", "mtrace-bin"], "line 2: caller address 0xffff"),
        ("+ 0x1000 " + "7" * 4300, ["dump"], "line 2: size 777777777777777777777777... does not fit in 64 bits"),
        ("+ 0x1000 18446744073709551616", ["dump", "--json"], "line 2: size 18446744073709551616 does not fit"),
        (
            "- 0x" + "0" * 5000 + "1" + "f" * 4300,
            ["dump", "--stats"],
            "line 2: address 0x0000000000000000000000... does not fit",
        ),
    ],
)
def test_oversized_numbers_in_text_logs_are_one_line_errors(tmp_path, line, command, message):
    src = tmp_path / "log.txt"
    src.write_text(f"= Start\n{line}\n= End\n")
    args = [command[0], src] + ([tmp_path / "out.bin"] if command[0] == "convert" else []) + command[1:]
    proc = run_pymtrace(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out.bin").exists()


def test_64_bit_extremes_in_text_logs_still_parse():
    top = (1 << 64) - 1
    ev = T.parse(f"= Start\n@ [0x{'0' * 30}{top:x}] + 0x{'0' * 30}{top:x} {top}\n".encode())
    assert (ev[0].addr, ev[0].size) == (top, top)
    (rec,) = T.to_records(ev)
    assert rec.caller == top and B.pack(rec)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 300), st.integers(0, 1 << 300), st.booleans(), st.integers(0, 40))
def test_fuzz_text_numbers_fit_or_are_corrupt(addr, size, hexsize, zeros):
    """Any number in a text log: a record that packs into the binary format, or CorruptFile."""
    s = f"0x{'0' * zeros}{size:x}" if hexsize else f"{'0' * zeros}{size}"
    data = f"= Start\n@ [0x{addr:x}] + 0x{'0' * zeros}{addr:x} {s}\n"
    try:
        recs = list(T.to_records(T.parse(data)))
    except CorruptFile as exc:
        assert "does not fit in 64 bits" in str(exc) and (addr >> 64 or size >> 64)
        return
    assert addr < 1 << 64 and size < 1 << 64
    assert B.pack(recs[0]) and recs[0].size == size


# -- bounded memory -----------------------------------------------------------------------
def _synthetic_bin(path, n):
    rec = struct.Struct("<iIQQQQQQQ")
    with open(path, "wb") as f:
        f.write(MAGIC)
        for i in range(0, n, 2):
            ptr = 0x10000 + 16 * i
            f.write(
                rec.pack(7 + i % 3, B.MALLOC, 0, ptr, 16 + i % 1000, 0, 32, 1000 + i, 0x401000 + i % 64)
                + rec.pack(7 + i % 3, B.FREE, ptr, 0, 0, 32, 0, 1001 + i, 0x401100)
            )
    return path


def _synthetic_text(path, n):
    with open(path, "w") as f:
        f.write("= Start\n")
        for i in range(0, n, 2):
            ptr = 0x10000 + 16 * i
            f.write(f"@ [{0x401000 + i % 64:#x}] + {ptr:#x} {16 + i % 1000:#x}\n@ /bin/prog:[0x1240] - {ptr:#x}\n")
        f.write("= End\n")
    return path


def _peak_rss_kib(*args):
    """Peak RSS of `pymtrace ARGS` (stdout discarded), measured in a fresh parent so that
    RUSAGE_CHILDREN covers that one child only."""
    import subprocess
    import sys

    from support.cli import PYMTRACE
    from support.paths import ROOT

    code = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *PYMTRACE, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    rc, kib = out.stdout.split()
    assert rc == "0", out.stderr
    return int(kib)


@pytest.mark.parametrize(
    "kind, command",
    [
        ("bin", ["dump", "--json"]),
        ("text", ["dump", "--json"]),
        ("text", ["convert", "--to", "mtrace-bin"]),
    ],
)
def test_memory_does_not_grow_with_the_file(tmp_path, kind, command):
    """dump --json and reading text logs stream: 8x the records, about the same peak RSS."""
    make = _synthetic_bin if kind == "bin" else _synthetic_text
    peaks = []
    for n in (30000, 240000):
        src = make(tmp_path / f"t{n}.{kind}", n)
        extra = [tmp_path / f"out{n}"] if command[0] == "convert" else []
        peaks.append(_peak_rss_kib(*command[:1], src, *extra, *command[1:]))
    small, big = peaks
    assert big < small * 1.2 + 8192, f"peak RSS {small} KiB for 30,000 records, {big} KiB for 240,000"
