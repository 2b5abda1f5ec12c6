"""Readers of files another user can hand pymtrace: deeply nested JSON in every JSON reader
(stack tables, collector frames and state files, web configs) and a valid Parquet recording
cut into thousands of one-row row groups, read in bounded memory and, when memory runs out,
ended with one line of error and a non-zero exit, never a signal."""

import json
import os
import resource
import subprocess

import numpy
import pyarrow.parquet as pq
import pytest
from support.cli import PYMTRACE, run_pymtrace

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.net import collector
from pymtrace.net import protocol as proto
from pymtrace.sinks import webconfig
from pymtrace.trace import stacktable
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P

DEEP = b"[" * 200_000  # far past Python's recursion limit


def one_error_line(proc, code):
    """PROC ended with exit CODE and exactly one `pymtrace: error:` line, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("pymtrace: error: "), proc.stderr[-2000:]
    return lines[0]


def stacks_trace(path):
    """An mtrace-bin trace marked for stacks: a malloc with stack 1, its free."""
    malloc = B.pack(B.Record(7, B.MALLOC, 0, 0x1000, 16, 0, 32, 5, 0x400))
    word = int.from_bytes(malloc[4:8], "little") | 1 << 8
    path.write_bytes(
        B.magic_record(7, stacks=True)
        + malloc[:4]
        + word.to_bytes(4, "little")
        + malloc[8:]
        + B.pack(B.Record(7, B.FREE, 0x1000, 0, 0, 32, 0, 6, 0x400))
    )


HEADER = json.dumps({"format": stacktable.FORMAT, "version": stacktable.VERSION, "trace": "t", "pid": 7}).encode()


@pytest.mark.parametrize("line", [DEEP, b'{"id": 1, "complete": true, "frames": ' + DEEP + b"\n"])
def test_nested_stack_table_is_one_error_line(tmp_path, line):
    with pytest.raises(CorruptFile, match="line 2 is not JSON"):
        stacktable.parse_table([HEADER + b"\n", line], "t.stacks")
    trace = tmp_path / "t"
    stacks_trace(trace)
    (tmp_path / "t.stacks").write_bytes(HEADER + b"\n" + line)
    for args in (["--stacks"], ["--json"], ["--stats"]):
        err = one_error_line(run_pymtrace("dump", *args, trace), 2)
        assert "t.stacks: line 2 is not JSON" in err


def test_nested_stack_table_analyze(tmp_path):
    """analyze reads the stack table of a Parquet recording with stack ids."""
    trace = tmp_path / "t"
    stacks_trace(trace)
    run_pymtrace("convert", trace, tmp_path / "t.parquet", "--to", "parquet", check=True)
    (tmp_path / "t.parquet.stacks").write_bytes(HEADER + b"\n" + DEEP + b"\n")
    for args in ([], ["--json"]):
        err = one_error_line(run_pymtrace("analyze", *args, "--threads", "1", tmp_path / "t.parquet"), 2)
        assert "t.parquet.stacks: line 2 is not JSON" in err


def test_nested_collector_frame_and_state(tmp_path):
    with pytest.raises(proto.ProtocolError, match="malformed JSON"):
        proto.parse_json(DEEP)
    with pytest.raises(proto.ProtocolError, match="malformed JSON"):
        proto.parse_json(b'{"pid": ' + DEEP + b"}")
    (tmp_path / ".stream-s1.json").write_bytes(b'{"acked": ' + DEEP)
    (tmp_path / ".stream-s2.json").write_bytes(b'{"acked": 5, "ended": true}')
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert collector.read_state(fd, "s1") == {}  # unreadable state: the stream starts over
        assert collector.read_state(fd, "s2") == {"acked": 5, "ended": True}
    finally:
        os.close(fd)


@pytest.mark.parametrize("deep", [DEEP, b"a:\n" + b"".join(b" " * i + b"- \n" for i in range(1, 3000))])
def test_nested_web_configs(tmp_path, deep):
    """Web configs are YAML, a superset of JSON: nesting beyond the parser's stack is one error."""
    path = tmp_path / "web.yml"
    path.write_bytes(deep)
    with pytest.raises(PymtraceError, match="web config"):
        webconfig.load(str(path))
    with pytest.raises(PymtraceError, match="web config"):
        proto.load_client_config(str(path))


# ---------------------------------------------------------------- many row groups

ROW_GROUPS = 3000


def many_groups_records(n):
    """N records of a malloc/free churn: the call type alternates, so consecutive one-row row
    groups carry different dictionaries for the `type` column."""
    recs = numpy.zeros(n, B.record_dtype("<"))
    recs["thread"] = 7 + numpy.arange(n) % 3
    recs["type"] = numpy.where(numpy.arange(n) % 2, B.FREE, B.MALLOC)
    recs["ptr2"][::2] = 0x1000 + 16 * numpy.arange(n)[::2]
    recs["ptr1"][1::2] = recs["ptr2"][::2][: n // 2]
    recs["size"][::2] = 32
    recs["size3"] = 48
    recs["time_ns"] = 10**9 + numpy.arange(n, dtype=numpy.uint64)
    recs["caller"] = 0x401000 + numpy.arange(n) % 5
    return recs


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory):
    """(Parquet file of ROW_GROUPS one-row row groups written by pyarrow's own writer with its
    defaults, the same records as mtrace-bin bytes)."""
    tmp = tmp_path_factory.mktemp("groups")
    recs = many_groups_records(ROW_GROUPS)
    path = tmp / "groups.parquet"
    pq.write_table(P.table_from_records(recs).replace_schema_metadata(P.file_metadata(pid=7)), path, row_group_size=1)
    assert pq.ParquetFile(path).num_row_groups == ROW_GROUPS
    return path, B.magic_record(7, "<") + P.raw_bytes(recs)


def test_many_row_groups_read_in_batches(many_groups):
    path, raw = many_groups
    sizes = [b.num_rows for b in P.iter_batches(str(path), batch_size=1000)]
    assert sizes == [1000, 1000, 1000]  # one-row groups gathered into whole batches
    recs = numpy.concatenate(list(P.iter_arrays(str(path))))
    assert B.magic_record(7, "<") + P.raw_bytes(recs) == raw


def test_many_row_groups_commands(many_groups, tmp_path):
    path, raw = many_groups
    out = tmp_path / "out.bin"
    run_pymtrace("convert", path, out, "--to", "mtrace-bin", check=True)
    assert out.read_bytes() == raw
    stats = json.loads(run_pymtrace("dump", "--json", "--stats", path, check=True).stdout)
    assert stats["stats"]["records"] == ROW_GROUPS
    run_pymtrace("workload", path, "-o", tmp_path / "out.wl", check=True)
    assert (tmp_path / "out.wl").stat().st_size > 0


def _limited(limit):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return set_limit


def _needed_address_space(args):
    """The smallest address-space limit (MiB, to 16) under which `pymtrace ARGS` succeeds."""
    lo, hi = 64, 4096
    while hi - lo > 16:
        mid = (lo + hi) // 2
        proc = subprocess.run(PYMTRACE + args, capture_output=True, preexec_fn=_limited(mid << 20), timeout=300)
        lo, hi = (lo, mid) if proc.returncode == 0 else (mid, hi)
    return hi


def _base(tmp_path):
    """The address space (MiB) a read of a 10-row file needs: where the limits start."""
    small = tmp_path / "small.parquet"
    pq.write_table(P.table_from_records(many_groups_records(10)), small)
    return _needed_address_space(["dump", "--stats", str(small)])


def _sweep(commands, base, check=None):
    """Run each of COMMANDS ({name: args}) under address-space limits from BASE MiB up: each
    ends with success (then CHECK(name), if given) or one line of error and a non-zero exit."""
    for name, args in commands.items():
        for extra in range(0, 300, 25):
            limit = (base + extra) << 20
            proc = subprocess.run(
                PYMTRACE + args, capture_output=True, text=True, preexec_fn=_limited(limit), timeout=300
            )
            where = f"{name} under {base + extra} MiB (base {base}): rc={proc.returncode} {proc.stderr[-400:]!r}"
            assert proc.returncode in (0, 1, 2), where
            if proc.returncode:
                lines = proc.stderr.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("pymtrace: error: "), where
            elif check is not None:
                check(name, where)


def test_many_row_groups_under_address_space_limits(many_groups, tmp_path):
    """Under an address-space limit too small for the file, each reader ends with one line of
    error and a non-zero exit; never a signal or an abort from a worker thread."""
    path, raw = many_groups
    commands = {
        "dump": ["dump", "--stats", str(path)],
        "convert": ["convert", str(path), str(tmp_path / "out.bin"), "--to", "mtrace-bin", "--force"],
        "convert-parquet": ["convert", str(path), str(tmp_path / "out.parquet"), "--to", "parquet", "--force"],
        "workload": ["workload", str(path), "-o", str(tmp_path / "out.wl"), "--force"],
    }

    def check(name, where):
        if name == "convert":
            assert (tmp_path / "out.bin").read_bytes() == raw, where

    _sweep(commands, _base(tmp_path), check)


def test_rewritten_file_read_afresh(many_groups, tmp_path):
    """A file replaced at the same path between two reads is read as it is now."""
    path, _ = many_groups
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(path.read_bytes())
    assert sum(len(r) for r in P.iter_arrays(str(copy))) == ROW_GROUPS
    pq.write_table(P.table_from_records(many_groups_records(5)), copy)
    assert sum(len(r) for r in P.iter_arrays(str(copy))) == 5
    assert P.open_file(str(copy)).metadata.num_rows == 5
