"""Parquet recordings: schema, byte-identical round trips with mtrace-bin, a file readable after
every row group (pyarrow and DuckDB), disk full, and corrupt files as one-line errors."""

import collections
import copy
import os
import shutil
import subprocess
import sys

import duckdb
import numpy
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli import run_pymtrace

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P
from pymtrace.trace.formats.autodetect import load_records

U64 = st.integers(0, (1 << 64) - 1)
RECORD = st.builds(
    B.Record,
    thread=st.integers(-(1 << 31), (1 << 31) - 1),
    type=st.sampled_from(sorted(B.TYPE_NAMES.keys() - {B.MAGIC_TYPE})),
    ptr1=U64,
    ptr2=U64,
    size=U64,
    size2=U64,
    size3=U64,
    ts_ns=U64,
    caller=U64,
    path=st.integers(0, 0x3FFF),
)


def bin_bytes(records, thread=1234, order="<"):
    return B.magic_record(thread, order) + b"".join(B.pack(r, order) for r in records)


def storm(n):
    """N records like a malloc/free storm's: alternating calls, rising time."""
    recs = numpy.zeros(n, B.record_dtype("<"))
    recs["thread"] = 77
    recs["type"] = numpy.where(numpy.arange(n) % 2, B.FREE, B.MALLOC)
    recs["ptr2"][::2] = 0x5000_0000 + 16 * (numpy.arange(n)[::2] % 5)
    recs["ptr1"][1::2] = recs["ptr2"][::2][: n // 2]
    recs["size"][::2] = 64
    recs["time_ns"] = 10**12 + 1400 * numpy.arange(n, dtype=numpy.uint64)
    recs["caller"] = 0x401000
    return recs


def to_parquet(tmp_path, raw, name="t"):
    src = tmp_path / f"{name}.bin"
    src.write_bytes(raw)
    dst = tmp_path / f"{name}.parquet"
    with open(dst, "xb") as out:
        P.convert_to_parquet(str(src), "mtrace-bin", out)
    return dst


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(RECORD, max_size=40), st.integers(-(1 << 31), (1 << 31) - 1), st.sampled_from("<>"))
def test_bin_parquet_bin_is_byte_identical(tmp_path_factory, records, thread, order):
    tmp = tmp_path_factory.mktemp("rt")
    raw = bin_bytes(records, thread, order)
    dst = to_parquet(tmp, raw)
    back = tmp / "back.bin"
    with open(back, "wb") as out:
        assert P.write_mtrace_bin(str(dst), out) == len(records)
    assert back.read_bytes() == raw
    assert list(P.iter_records(str(dst))) == records
    assert load_records(str(dst))[0] == "parquet"


def test_schema_columns_and_metadata(tmp_path):
    assert P.SCHEMA.names == [
        "thread",
        "type",
        "ptr1",
        "ptr2",
        "size",
        "size2",
        "size3",
        "time_ns",
        "caller",
        "path",
        "stack",
    ]
    assert [f.name for f in P.SCHEMA if f.nullable] == ["stack"]
    dst = to_parquet(tmp_path, bin_bytes([B.Record(5, B.MALLOC, 0, 0x10, 8, 0, 32)], thread=99))
    pf = pq.ParquetFile(dst)
    assert pf.schema_arrow.remove_metadata().equals(P.SCHEMA.remove_metadata())
    meta = P.read_metadata(str(dst))
    assert meta["format_version"] == P.FORMAT_VERSION and meta["magic_thread"] == "99"
    assert meta["byteorder"] == "little" and meta["source_format"] == "mtrace-bin"
    col = pf.metadata.row_group(0).column(7)  # time_ns
    assert col.path_in_schema == "time_ns" and "DELTA_BINARY_PACKED" in col.encodings
    assert pf.metadata.row_group(0).column(1).compression == "ZSTD"
    assert "RLE_DICTIONARY" in pf.metadata.row_group(0).column(1).encodings  # type


def test_every_call_type_through_pyarrow_and_duckdb(tmp_path):
    records = [B.Record(7, t, 0, 0x100 * t, t, 0, 0) for t in range(1, 9) for _ in range(t)]
    dst = to_parquet(tmp_path, bin_bytes(records))
    names = pq.read_table(dst, columns=["type"]).column("type").to_pylist()
    want = {B.TYPE_NAMES[t]: t for t in range(1, 9)}
    assert collections.Counter(names) == want
    got = dict(duckdb.sql(f"select type, count(*) from '{dst}' group by type").fetchall())
    assert got == want


def test_writer_file_is_complete_after_every_row_group(tmp_path):
    """What a SIGKILL leaves: after each row group the file is a whole Parquet file."""
    path = tmp_path / "w.parquet"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w = P.Writer(fd, P.file_metadata(pid=1), row_group_rows=1000)
    assert pq.read_table(path).num_rows == 0  # readable from the start
    recs = storm(10_500)
    for i in range(0, len(recs), 700):
        w.write_records(recs[i : i + 700])
        snap = tmp_path / "snap.parquet"
        shutil.copyfile(path, snap)  # the file as a kill at this moment leaves it
        rows = pq.read_table(snap).num_rows
        assert rows == (i + 700) // 1000 * 1000 == w.rows
        assert duckdb.sql(f"select count(*) from '{snap}'").fetchall()[0][0] == rows
        assert os.path.getsize(path) == w.size
    w.close()
    os.close(fd)
    table = pq.read_table(path)
    assert table.num_rows == len(recs) and pq.ParquetFile(path).metadata.num_row_groups == 11
    back = numpy.concatenate(list(P.iter_arrays(str(path))))
    assert back.tobytes() == recs.tobytes()
    md = pq.ParquetFile(path).metadata
    starts = [md.row_group(i).column(0).data_page_offset for i in range(11)]
    assert starts == sorted(starts) and len(set(starts)) == 11


def test_writer_flushes_by_time(tmp_path):
    path = tmp_path / "t.parquet"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w = P.Writer(fd, flush_interval=2.0)
    w.write_records(storm(10))
    assert not w.maybe_flush(w.pending_since + 1.0)
    assert w.maybe_flush(w.pending_since + 2.5)
    assert pq.read_table(path).num_rows == 10 and w.type_counts[B.MALLOC] == 5
    os.close(fd)


DISK_FULL = """
import os, resource, signal, sys
import numpy
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
w = P.Writer(fd, row_group_rows=5000)
rng = numpy.random.default_rng(1)
try:
    for _ in range(1000):
        recs = numpy.zeros(5000, B.record_dtype("<"))
        recs["type"] = B.MALLOC
        recs["ptr1"] = rng.integers(0, 1 << 63, 5000, dtype=numpy.uint64)  # incompressible
        w.write_records(recs)
except OSError as exc:
    print("FAILED", exc.errno, w.rows, w.size)
"""


def test_writer_disk_full_keeps_every_row_group(tmp_path):
    path = tmp_path / "full.parquet"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(path)], capture_output=True, text=True, cwd=root, timeout=60
    )
    word, errno, rows, size = p.stdout.split()
    assert word == "FAILED" and int(errno) == 27  # EFBIG: the file size limit, like a full disk
    assert int(rows) >= 5000 and os.path.getsize(path) == int(size)
    assert pq.read_table(path).num_rows == int(rows)


def test_convert_cli_every_direction(tmp_path):
    records = [
        B.Record(10, B.MALLOC, 0, 0x1000, 16, 0, 32, ts_ns=5, caller=0x401000),
        B.Record(11, B.REALLOC, 0x1000, 0x3000, 64, 32, 80, ts_ns=9),
        B.Record(10, B.FREE, 0x3000, 0, 0, 80, 0, ts_ns=12),
    ]
    src = tmp_path / "t.bin"
    src.write_bytes(bin_bytes(records))
    pqf, back, txt, txt2, pq2 = (tmp_path / n for n in ("t.parquet", "b.bin", "t.txt", "t2.txt", "t2.parquet"))
    run_pymtrace("convert", src, pqf, "--to", "parquet", check=True)
    assert oct(os.stat(pqf).st_mode & 0o777) == "0o600"
    run_pymtrace("convert", pqf, back, "--to", "mtrace-bin", check=True)
    assert back.read_bytes() == src.read_bytes()
    run_pymtrace("convert", pqf, txt, "--to", "mtrace-text", check=True)
    run_pymtrace("convert", src, txt2, "--to", "mtrace-text", check=True)
    assert txt.read_text() == txt2.read_text()
    run_pymtrace("convert", txt, pq2, "--to", "parquet", check=True)
    assert pq.read_table(pq2).column("type").to_pylist() == ["malloc", "realloc", "free"]
    again = run_pymtrace("convert", src, pqf, "--to", "parquet")
    assert again.returncode == 1 and "exists" in again.stderr
    run_pymtrace("convert", src, pqf, "--to", "parquet", "--force", check=True)
    dump = run_pymtrace("dump", "--json", pqf, check=True)
    assert '"records": 3' in dump.stdout or '"records":3' in dump.stdout
    wl1, wl2 = tmp_path / "a.wl", tmp_path / "b.wl"
    run_pymtrace("workload", src, "-o", wl1, check=True)
    run_pymtrace("workload", pqf, "-o", wl2, check=True)
    assert wl1.read_bytes() == wl2.read_bytes()


def real_file(tmp_path):
    recs = storm(3000)
    path = tmp_path / "real.parquet"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w = P.Writer(fd, P.file_metadata(pid=1), row_group_rows=1000)
    w.write_records(recs)
    w.close()
    os.close(fd)
    return path.read_bytes()


@pytest.mark.parametrize("cut", [0, 4, 100, -1, -9, -200])
def test_truncated_file_is_one_line_exit_2(tmp_path, cut):
    data = real_file(tmp_path)
    bad = tmp_path / "cut.parquet"
    bad.write_bytes(data[: cut if cut > 0 else len(data) + cut] if cut else b"PAR1")
    for cmd in (["dump"], ["dump", "--stats"], ["convert", "--to", "mtrace-bin"], ["workload", "-o"]):
        args = [cmd[0], bad, *cmd[1:]]
        if cmd[0] in ("convert", "workload"):
            args.append(tmp_path / f"out{len(cmd)}")
        p = run_pymtrace(*args)
        assert p.returncode == 2, (cmd, p.stderr)
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("pymtrace: error: ") and "Traceback" not in p.stderr
        assert not (tmp_path / f"out{len(cmd)}").exists()


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return real_file(tmp_path_factory.mktemp("fuzz"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_corrupted_file_reads_or_is_corrupt(tmp_path_factory, good_file, data):
    """Corrupted bytes of a real file: the rows, or CorruptFile; never another exception."""
    buf = bytearray(good_file)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    path = tmp_path_factory.mktemp("f") / "x.parquet"
    path.write_bytes(bytes(buf))
    try:
        _, records = load_records(str(path))
        for _ in records:
            pass
    except CorruptFile as exc:
        assert "\n" not in str(exc)


def test_foreign_parquet_file_is_refused(tmp_path):
    path = tmp_path / "other.parquet"
    duckdb.sql(f"copy (select 1 as a) to '{path}' (format parquet)")
    with pytest.raises(CorruptFile, match="not a pymtrace Parquet trace: no column thread"):
        list(load_records(str(path))[1])


def test_duckdb_written_file_with_plain_strings_reads(tmp_path):
    """A trace rewritten by another tool (plain string `type`, signed integers) still reads."""
    src = to_parquet(tmp_path, bin_bytes([B.Record(3, B.CALLOC, 0, 0x20, 4, 0, 32)]))
    out = tmp_path / "duck.parquet"
    duckdb.sql(f"copy (select * exclude (type), type::varchar as type from '{src}') to '{out}' (format parquet)")
    assert list(P.iter_records(str(out))) == [B.Record(3, B.CALLOC, 0, 0x20, 4, 0, 32)]


def _outcome(reader, raw):
    import io

    try:
        return reader(io.BytesIO(raw))
    except CorruptFile as exc:
        return str(exc)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(RECORD, max_size=12),
    st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=4),
    st.integers(0, 64),
)
def test_vectorized_bin_reader_matches_iter_records(records, flips, cut):
    """mtrace_bin.read_arrays (convert's path) accepts and refuses exactly what iter_records does."""
    raw = bytearray(bin_bytes(records) + b"\0" * 64 + B.magic_record())
    for pos, byte in flips:
        if pos < len(raw):
            raw[pos] = byte
    raw = bytes(raw[: len(raw) - cut])

    def vectorized(stream):
        _, _, arrays = B.read_arrays(stream, "t", chunk_records=5)
        return [r for recs in arrays for r in P.iter_records_of(recs)]

    assert _outcome(vectorized, raw) == _outcome(lambda s: list(B.iter_records(s, "t", chunk_records=5)), raw)


class _Killed(Exception):
    pass


def _kill_after(m, budget):
    """Make the writer's file writes stop for good after BUDGET more bytes (a SIGKILL there:
    the bytes before it are in the file, nothing after); an ftruncate counts as one byte."""
    left = [budget]
    real_pwritev, real_ftruncate = os.pwritev, os.ftruncate

    def pwritev(fd, views, offset):
        if left[0] <= 0:
            raise _Killed
        done = real_pwritev(fd, [memoryview(views[0]).cast("B")[: left[0]]], offset)
        left[0] -= done
        return done

    def ftruncate(fd, size):
        if left[0] <= 0:
            raise _Killed
        left[0] -= 1
        return real_ftruncate(fd, size)

    m.setattr(P.os, "pwritev", pwritev)
    m.setattr(P.os, "ftruncate", ftruncate)


@pytest.mark.parametrize("groups", [1, 12])  # the old footer within a page; over 2 pages
def test_writer_killed_at_any_byte_of_a_row_group_leaves_a_readable_or_repairable_file(tmp_path, monkeypatch, groups):
    """Kill the writer after any number of the bytes one row group's write makes: the file
    reads, with the rows before it or with all; or, killed while the old footer is copied to
    the new end, `pymtrace repair` cuts it back to exactly the rows before it."""
    recs = storm(groups * 7 + 5)
    path = tmp_path / "k.parquet"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w0 = P.Writer(fd, P.file_metadata(pid=1), row_group_rows=7)
    w0.write_records(recs)  # GROUPS row groups written, 5 rows buffered
    os.close(fd)
    before, before_bytes = w0.rows, path.read_bytes()
    old = len(w0.footer)
    # kill points: the first bytes, around the end of the footer copy, and strides through
    # it and then through the data and new footer until the write completes
    budgets = (
        set(range(64)) | set(range(old - 2, old + 3)) | set(range(0, old, 211)) | set(range(old, old + 10**6, 997))
    )
    cli_checked = False
    for budget in sorted(budgets):
        path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(fd, before_bytes, 0)
        w = copy.copy(w0)
        w.fd, w.row_groups, w.pending = fd, list(w0.row_groups), w0.pending.copy()
        killed = False
        with monkeypatch.context() as m:
            _kill_after(m, budget)
            try:
                w.close()
            except _Killed:
                killed = True
        os.close(fd)
        try:
            rows = pq.read_table(path).num_rows
        except Exception:
            assert killed and budget < old, budget  # only while the old footer is being copied
            assert P.complete_end(str(path))[1] == before
            if not cli_checked:  # the user's way, once
                cli_checked = True
                dump = run_pymtrace("dump", "--stats", path)
                assert dump.returncode == 2 and dump.stderr.count("\n") == 1
                assert f"pymtrace repair {path}` keeps the {before} rows" in dump.stderr
                fixed = run_pymtrace("repair", path)
                assert fixed.returncode == 0 and f"{before} rows kept" in fixed.stdout, fixed.stderr
                again = run_pymtrace("repair", path)
                assert again.returncode == 1 and "nothing to repair" in again.stderr
            else:
                assert P.repair(str(path))[0] == before
            rows = pq.read_table(path).num_rows
            assert rows == before and path.read_bytes() == before_bytes
        assert rows == (before if killed else len(recs)), budget  # the new rows: after the truncate
        back = numpy.concatenate(list(P.iter_arrays(str(path)))) if rows else recs[:0]
        assert back.tobytes() == recs[:rows].tobytes()
        if not killed:
            break
    else:
        pytest.fail("the write never completed within the budgets tried")
    assert cli_checked


def test_repair_refuses_a_complete_file_and_a_foreign_one(tmp_path):
    good = tmp_path / "good.parquet"
    good.write_bytes(real_file(tmp_path))
    with pytest.raises(PymtraceError, match="nothing to repair"):
        P.repair(str(good))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + bytes(5000) + b"PAR1PAR1 partial")
    p = run_pymtrace("repair", junk)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no complete pymtrace Parquet footer" in p.stderr
    assert junk.read_bytes().endswith(b"partial")  # untouched
    link = tmp_path / "link.parquet"
    link.symlink_to(junk)
    p = run_pymtrace("repair", link)
    assert p.returncode == 1 and "cannot open" in p.stderr and p.stderr.count("\n") == 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_complete_end_of_corrupted_bytes_is_a_footer_or_none(tmp_path_factory, good_file, data):
    """Whatever the bytes, complete_end answers None or an end whose file reads (no exception)."""
    buf = bytearray(good_file)
    buf += data.draw(st.binary(max_size=300))
    for _ in range(data.draw(st.integers(0, 6))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("c") / "x.parquet"
    path.write_bytes(bytes(buf))
    kept = P.complete_end(str(path))
    if kept is not None:
        cut = path.with_name("cut.parquet")
        cut.write_bytes(bytes(buf[: kept[0]]))
        assert pq.ParquetFile(cut).metadata.num_rows == kept[1]
