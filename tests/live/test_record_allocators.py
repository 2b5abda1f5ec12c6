"""`record -p` and `record -- CMD` on a process whose malloc is not glibc's:
Debian's jemalloc, tcmalloc and mimalloc LD_PRELOADed, and an allocator defined in the
executable, against tests/support/workloads/top_calls.c's exact tally (-DANY_ALLOCATOR);
mtrace-bin and Parquet, with the allocator family in the trace's metadata."""

import collections
import json

import pyarrow.parquet as pq
import pytest
from support.allocators import LIBS, library, record_workload
from support.cli import run_pymtrace
from support.recording import text_range
from support.top import Workload

from pymtrace.trace.formats import mtrace_bin as B

pytestmark = pytest.mark.bpf

TYPES = ("malloc", "calloc", "free", "realloc", "memalign", "valloc", "pvalloc", "posix_memalign")


def _counts(types):
    return {name: sum(1 for t in types if t == getattr(B, name.upper())) for name in TYPES}


def _expected(result):
    return {name: result["calls"].get(name, 0) for name in TYPES}


def _workload(cbuild, name):
    if name == "own":
        return Workload([cbuild("top_calls_own")])
    binary = cbuild("top_calls", "-DANY_ALLOCATOR")
    return Workload(["env", f"LD_PRELOAD={library(LIBS[name])}", binary])


@pytest.mark.parametrize("name", sorted(LIBS) + ["own"])
def test_record_counts_another_allocator_exactly(cbuild, tmp_path, name):
    out = tmp_path / "trace"
    expected = record_workload(_workload(cbuild, name), out)
    with open(out, "rb") as f:
        magic = f.read(64)
    assert B.allocator_of(magic) == ("generic" if name == "own" else name)
    records = list(B.read_file(out))
    assert _counts([r.type for r in records]) == _expected(expected)
    assert all(r.size3 == 0 for r in records)  # no glibc chunk header read
    sizes = sorted(r.size for r in records if r.type == B.MALLOC)
    assert sizes and sizes[-1] > 0


def test_record_parquet_names_the_allocator(cbuild, tmp_path):
    out = tmp_path / "trace.parquet"
    expected = record_workload(_workload(cbuild, "jemalloc"), out, "--format", "parquet")
    table = pq.read_table(out)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["pymtrace.allocator"] == "jemalloc"
    assert "libjemalloc" in meta["pymtrace.allocator_path"]
    names = [str(t) for t in table.column("type").to_pylist()]
    assert {name: names.count(name) for name in TYPES} == _expected(expected)


@pytest.mark.parametrize("name", sorted(LIBS))
def test_record_cmd_follows_env_into_a_preloaded_allocator(cbuild, tmp_path, name):
    """`record -- env LD_PRELOAD=LIB PROG`: env runs on glibc and execs PROG, whose loader maps
    LIB; PROG is stopped once its objects are mapped, LIB probed, and every call PROG makes
    is recorded exactly (by its call sites), the trace naming LIB's family."""
    prog = cbuild("top_calls", "-DANY_ALLOCATOR", "-no-pie")
    out = tmp_path / "trace"
    r = run_pymtrace(
        "record", "--json", "-o", out, "--", "env", f"LD_PRELOAD={library(LIBS[name])}", prog, input="xx", timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    truth = json.loads(r.stdout.splitlines()[-1])
    with open(out, "rb") as f:
        assert B.allocator_of(f.read(64)) == name
    lo, hi = text_range(prog)
    records = [rec for rec in B.read_file(out) if lo <= rec.caller < hi]
    assert _counts([rec.type for rec in records]) == _expected(truth)
    assert all(rec.size3 == 0 for rec in records)  # no glibc chunk header read on LIB's blocks


def test_record_cmd_on_glibc_keeps_chunk_sizes(cbuild, tmp_path):
    """The same command on glibc: exact, glibc's chunk sizes read, no allocator named."""
    prog = cbuild("top_calls", "-DANY_ALLOCATOR", "-no-pie")
    out = tmp_path / "trace"
    r = run_pymtrace("record", "--json", "-o", out, "--", prog, input="xx", timeout=300)
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout.splitlines()[-1])
    with open(out, "rb") as f:
        assert B.allocator_of(f.read(64)) is None
    lo, hi = text_range(prog)
    records = [rec for rec in B.read_file(out) if lo <= rec.caller < hi]
    assert _counts([rec.type for rec in records]) == _expected(truth)
    assert all(rec.size3 for rec in records if rec.type == B.MALLOC and rec.ptr2)


def test_record_cmd_records_cxx_new_and_delete(tmp_path):
    """`record -- CXXPROG`: operator new/delete recorded per docs/formats.md's mapping (new,
    new[], nothrow -> malloc; aligned new -> memalign; every delete -> free), each once."""
    import shutil
    import subprocess

    from support.needs import missing_or_fail
    from support.paths import ROOT

    if shutil.which("g++") is None:
        missing_or_fail("g++ is not installed")
    prog = tmp_path / "cxx_calls"
    src = ROOT / "tests/support/workloads/cxx_calls.cpp"
    subprocess.run(["g++", "-O1", "-std=c++17", "-fsized-deallocation", "-no-pie", "-o", prog, src], check=True)
    out = tmp_path / "trace"
    r = run_pymtrace("record", "--json", "-o", out, "--", prog, input="xx", timeout=300)
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout.splitlines()[-1])
    lo, hi = text_range(str(prog))
    got = collections.Counter(rec.type for rec in B.read_file(out) if lo <= rec.caller < hi)
    c = truth["calls"]
    assert got[B.MALLOC] == c["new"] + c["new_array"] + c["new_nothrow"]
    assert got[B.MEMALIGN] == c["new_aligned"]
    assert got[B.FREE] == sum(c[k] for k in ("delete", "delete_array", "delete_sized", "delete_aligned"))
    assert sum(got.values()) == got[B.MALLOC] + got[B.MEMALIGN] + got[B.FREE]  # the malloc inside: not again


def test_record_cmd_parquet_names_the_allocator_exec_reached(cbuild, tmp_path):
    """Parquet: the metadata names the allocator of the program env exec'd (rewritten footer)."""
    prog = cbuild("top_calls", "-DANY_ALLOCATOR", "-no-pie")
    out = tmp_path / "trace.parquet"
    lib = library(LIBS["jemalloc"])
    r = run_pymtrace("record", "-q", "-o", out, "--", "env", f"LD_PRELOAD={lib}", prog, input="xx", timeout=300)
    assert r.returncode == 0, r.stderr
    table = pq.read_table(out)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["pymtrace.allocator"] == "jemalloc"
    assert "libjemalloc" in meta["pymtrace.allocator_path"]
    lo, hi = text_range(prog)
    truth = json.loads(r.stdout.splitlines()[-1])
    rows = [
        str(t) for t, c in zip(table.column("type").to_pylist(), table.column("caller").to_pylist()) if lo <= c < hi
    ]
    assert {name: rows.count(name) for name in TYPES} == _expected(truth)
