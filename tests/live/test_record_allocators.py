"""`record -p` on a process whose malloc is not glibc's (issue 16): Debian's jemalloc,
tcmalloc and mimalloc LD_PRELOADed, and an allocator defined in the executable, against
tests/support/workloads/top_calls.c's exact tally (-DANY_ALLOCATOR); mtrace-bin and Parquet,
with the allocator family in the trace's metadata."""

import pyarrow.parquet as pq
import pytest
from support.allocators import LIBS, library, record_workload
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
