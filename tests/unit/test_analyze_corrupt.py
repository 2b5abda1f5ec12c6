"""`pymtrace analyze` on damaged Parquet that still opens (its footer parses): flipped bytes in
the footer and in the pages, pages cut short, NULLs in the columns the report reads. Each is
one line `pymtrace: error: FILE: ...` and exit status 2, never a traceback; a bounded fuzz of
byte flips over a small valid recording finds no other outcome."""

import random
import tempfile

import numpy
import pyarrow
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli import run_pymtrace

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace.analysis import TraceSet
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P


def small_recording():
    """A valid Parquet recording of 450 calls (three threads, frees of half the blocks)."""
    rows = []
    for i in range(300):
        rows.append((1 + i % 3, B.MALLOC, 0, 0x1000 + 16 * i, 10 + i, 0, 32, 1000 * i, 0x401000 + i % 7))
        if i % 2:
            rows.append((1, B.FREE, 0x1000 + 16 * i, 0, 0, 32, 0, 1000 * i + 500, 0x402000))
    with tempfile.TemporaryFile() as f:
        P.write_records(f, iter([numpy.array(rows, B.record_dtype("<"))]), P.file_metadata())
        f.seek(0)
        return f.read()


VALID = small_recording()


def outcome(path):
    """None when analyze's report succeeds on PATH, else the PymtraceError it raised (any
    other exception propagates: the test fails on it)."""
    try:
        with TraceSet([str(path)]) as ts:
            ts.report()
    except PymtraceError as exc:
        return exc
    return None


def opens(path):
    try:
        P.open_file(str(path))
    except CorruptFile:
        return False
    return True


def damaged_variants(tmp_path):
    """Files that pass the open check and that DuckDB cannot read: byte flips (footer and pages)
    and a page cut short (the file keeps its footer), found deterministically."""
    rnd = random.Random(7)
    footer_len = int.from_bytes(VALID[-8:-4], "little")
    footer_at = len(VALID) - 8 - footer_len
    found = {}
    for k in range(400):
        data = bytearray(VALID)
        kind = ("footer", "pages", "cut")[k % 3]
        if kind == "footer":
            data[rnd.randrange(footer_at, len(VALID) - 8)] ^= 1 << rnd.randrange(8)
        elif kind == "pages":
            for _ in range(3):
                data[rnd.randrange(4, footer_at)] = rnd.randrange(256)
        else:  # a page cut short: bytes removed from the data, the footer kept
            lo = rnd.randrange(4, footer_at - 64)
            del data[lo : lo + rnd.randrange(1, 64)]
        if kind in found:
            continue
        path = tmp_path / f"{kind}.parquet"
        path.write_bytes(data)
        if opens(path) and outcome(path) is not None:
            found[kind] = path
        if len(found) == 3:
            break
    return found


def nulls_file(tmp_path, column):
    """A Parquet file another tool wrote, with NULLs in COLUMN (pymtrace's schema has none)."""
    n = 6
    cols = {
        "thread": [1, 2, 1, 2, 1, 1],
        "type": ["malloc", "malloc", "free", "malloc", "realloc", "free"],
        "ptr1": [0, 0, 16, 0, 32, 48],
        "ptr2": [16, 32, 0, 48, 48, 0],
        "size": [10, 20, 0, 30, 40, 0],
        "size2": [0] * n,
        "size3": [0] * n,
        "time_ns": [1, 2, 3, 4, 5, 6],
        "caller": [0x401000] * n,
        "path": [0] * n,
    }
    cols[column] = [None, *cols[column][1:3], None, *cols[column][4:]]
    path = tmp_path / f"nulls-{column}.parquet"
    pq.write_table(pyarrow.table(cols), path)
    return path


def assert_one_line_exit_2(path):
    proc = run_pymtrace("analyze", path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pymtrace: error: {path}: "), proc.stderr
    assert proc.stdout == ""


def test_damaged_pages_and_footers_are_one_line_and_exit_2(tmp_path):
    found = damaged_variants(tmp_path)
    assert set(found) == {"footer", "pages", "cut"}, found
    for path in found.values():
        assert isinstance(outcome(path), CorruptFile)
        assert_one_line_exit_2(path)


@pytest.mark.parametrize("column", ["thread", "type", "size", "time_ns", "ptr1", "ptr2", "caller"])
def test_nulls_in_a_column_the_report_reads_are_one_line_and_exit_2(tmp_path, column):
    path = nulls_file(tmp_path, column)
    exc = outcome(path)
    assert isinstance(exc, CorruptFile) and f"NULL in column {column}" in str(exc), exc
    if column in ("thread", "size"):  # through the CLI too (each run costs a second)
        assert_one_line_exit_2(path)


def test_damage_in_one_of_many_files_names_that_file(tmp_path):
    good = tmp_path / "good.parquet"
    good.write_bytes(VALID)
    bad = damaged_variants(tmp_path)["pages"]
    with pytest.raises(CorruptFile, match=f"^{bad}: "):
        with TraceSet([str(good), str(bad)]) as ts:
            ts.report()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_fuzzed_bytes_never_escape_as_another_exception(tmp_path, flips, cut):
    data = bytearray(VALID)
    for pos, value in flips:
        data[pos] = value
    if cut is not None:
        data = data[:cut]
    path = tmp_path / "fuzz.parquet"
    path.write_bytes(data)
    exc = outcome(path)  # success, or a PymtraceError: nothing else
    assert exc is None or str(exc)
