"""`pymtrace record --stacks` on heap_chains (built -O2 -fomit-frame-pointer), in-process
(the interposer unwinds) and through uprobes (BPF copies the stack): every allocation record's
stack id resolves to the exact chain of its call, counts and bytes exact, in mtrace-bin and
Parquet, the same on both paths; through threads, a signal handler, fork and vfork+exec;
`dump` shows them; without --stacks nothing changes."""

import collections
import json
import os
import re
import stat
import subprocess

import duckdb
import pyarrow.parquet
import pytest
from support import heapchains
from support.cli import run_pymtrace
from support.interposer import truth
from support.paths import WORKLOADS

from pymtrace.bpf import load as bpfload
from pymtrace.trace import stacktable
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet

pytestmark = pytest.mark.bpf

ALLOCS = (B.MALLOC, B.CALLOC, B.REALLOC, B.MEMALIGN, B.VALLOC, B.PVALLOC, B.POSIX_MEMALIGN)


@pytest.fixture(scope="module")
def chains_exe(build_dir):
    return heapchains.build(build_dir)


def record(out, exe, *extra):
    proc = run_pymtrace("record", "--stacks", "--json", "-o", out, *extra, "--", exe, "0")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1])


def per_chain(records, table):
    """{chain name: (calls, bytes, ids)} of the workload's malloc records, by their stacks."""
    got = {name: [0, 0, set()] for name in heapchains.CHAINS}
    for r in records:
        if r.type != B.MALLOC or r.size < 100:
            continue
        folded = table[r.stack].folded()
        for name, (pattern, _, _) in heapchains.CHAINS.items():
            if re.fullmatch(pattern, folded):
                got[name][0] += 1
                got[name][1] += r.size
                got[name][2].add(r.stack)
    return got


def check_chains(records, table):
    assert all(r.stack for r in records if r.type in ALLOCS), "an allocation without a stack"
    assert not any(r.stack for r in records if r.type == B.FREE)  # frees carry no stack
    got = per_chain(records, table)
    for name, (_, calls, size) in heapchains.CHAINS.items():
        assert (got[name][0], got[name][1]) == (calls, size), (name, got[name])
        assert 1 <= len(got[name][2]) <= 3  # one id per call site (an unrolled loop: a few)
        for sid in got[name][2]:
            assert table[sid].complete
            leaf = table[sid].frames[-1]
            assert leaf.module.endswith("libc.so.6") and leaf.build_id
    # interned by content: no two ids with the same frames
    keys = [tuple((f.module, f.offset) for f in s.frames) for s in table.values()]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("via", ["interposer", "uprobes"])
def test_mtrace_bin_stacks_exact_and_dump(chains_exe, tmp_path, via):
    """Both paths: in-process (libunwind in the interposer) and through uprobes (BPF's stack
    copy, libdwfl)."""
    out = tmp_path / "t"
    summary = record(out, chains_exe, "--via", via)
    assert summary["via"] == via
    assert summary["stacks_lost"] == 0 and summary["lost"] == 0
    table_file = tmp_path / "t.stacks"
    assert stat.S_IMODE(os.stat(table_file).st_mode) == 0o600
    table = stacktable.read_table(str(table_file))
    assert summary["stacks"] == len(table)
    records = list(B.read_file(out))
    check_chains(records, table)

    listing = run_pymtrace("dump", "--stacks", out, check=True).stdout
    lines = listing.splitlines()
    first = next(i for i, line in enumerate(lines) if " malloc " in line and " 100 " in line)
    assert "stack=" in lines[first]
    under = [line.split()[0] for line in lines[first + 1 : first + 4]]
    assert re.fullmatch(heapchains.MALLOC, under[0]) and under[1:] == ["leaf_alloc", "beta"]
    stats = run_pymtrace("dump", "--stats", "--json", out, check=True).stdout
    top = json.loads(stats)["stats"]["top_stacks"]
    assert top[0]["bytes"] == heapchains.CHAINS["thread"][2] and top[0]["frames"][-3:-1] == ["worker", "thread_leaf"]

    # the table is refused where it does not fit, one line
    again = run_pymtrace("record", "--stacks", "-o", out, "--", chains_exe, "0")
    assert again.returncode == 1 and "exists" in again.stderr and "Traceback" not in again.stderr


def test_parquet_stacks(chains_exe, tmp_path):
    out = tmp_path / "t.parquet"
    summary = record(out, chains_exe)
    assert summary["stacks_lost"] == 0
    table = stacktable.read_table(str(out) + ".stacks")
    rows = pyarrow.parquet.read_table(out).to_pylist()
    assert all(r["stack_id"] for r in rows if r["type"] != "free")
    check_chains(list(parquet.iter_records(str(out))), table)
    # a real client joins the two (the query docs/formats.md shows)
    rows = duckdb.sql(
        f"select s.frames[-2].function, count(*), sum(t.size) from '{out}' t join "
        f"(select * from read_json('{out}.stacks') where id is not null) s on t.stack_id = s.id group by all"
    ).fetchall()
    by_caller = {name: (n, int(b)) for name, n, b in rows}
    assert by_caller["leaf_alloc"] == heapchains.CHAINS["alpha"][1:]
    assert by_caller["lib_inner"] == heapchains.CHAINS["gamma"][1:]


def test_without_stacks_unchanged(chains_exe, tmp_path):
    """No flag: no table, no marks in the records, and the BPF program has no stack code."""
    out = tmp_path / "plain"
    proc = run_pymtrace("record", "-o", out, "--", chains_exe, "0")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "plain.stacks").exists()
    raw = out.read_bytes()
    assert raw[:64] == B.magic_record(int.from_bytes(raw[:4], "little"))  # size2 0: no stack mark
    assert all(int.from_bytes(raw[i + 4 : i + 8], "little") >> 8 == 0 for i in range(64, len(raw), 64))
    counts = collections.Counter(r.type for r in B.read_file(out))
    assert counts[B.MALLOC] >= 263
    plain = bpfload.load("record", defines={"TARGET_TGID": 1})
    try:
        names = {k.decode() if isinstance(k, bytes) else k for k in plain.tables}
        assert "stacks" not in names and "stack_scratch" not in names
    finally:
        plain.cleanup()


def test_stacks_of_a_command_exec_d_onto_jemalloc(chains_exe, tmp_path):
    """`record --stacks -- env LD_PRELOAD=libjemalloc.so.2 PROG`: PROG's chains exact, with
    jemalloc's malloc as the leaf (the allocator its exec resolved to)."""
    from support.allocators import LIBS, library

    jemalloc = library(LIBS["jemalloc"])
    out = tmp_path / "je"
    proc = run_pymtrace(
        "record", "--stacks", "--json", "-o", out, "--", "env", f"LD_PRELOAD={jemalloc}", chains_exe, "0"
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["stacks_lost"] == 0 and summary["lost"] == 0
    table = stacktable.read_table(str(tmp_path / "je.stacks"))
    leaf = r"(je_)?malloc"
    got = {name: [0, 0] for name in heapchains.CHAINS}
    for r in B.read_file(out):
        if r.type != B.MALLOC or r.size < 100:
            continue
        frames = table[r.stack].frames
        for name, (pattern, _, _) in heapchains.CHAINS.items():
            if re.fullmatch(pattern[: -len(heapchains.MALLOC)] + leaf, table[r.stack].folded()):
                assert "libjemalloc" in frames[-1].module
                got[name][0] += 1
                got[name][1] += r.size
    assert got == {name: [calls, size] for name, (_, calls, size) in heapchains.CHAINS.items()}


def allocation_stacks(path):
    """Counter of (call type, size, folded stack) over PATH's allocation records."""
    table = stacktable.read_table(stacktable.table_path(str(path)))
    return collections.Counter((r.type, r.size, table[r.stack].folded()) for r in B.read_file(path) if r.type in ALLOCS)


def test_in_process_stacks_equal_the_uprobe_paths(chains_exe, tmp_path):
    """The same program recorded both ways: the same allocations on the same stacks, frame
    for frame (the leaf named the same way, return addresses located in the same files). One
    allocation differs by design: the loader sizes a thread's TLS vector by the objects with
    TLS, and the interposer (with libunwind) is two more."""
    got = {}
    for via in ("interposer", "uprobes"):
        out = tmp_path / via
        summary = record(out, chains_exe, "--via", via)
        assert summary["via"] == via and summary["stacks_lost"] == 0
        got[via] = allocation_stacks(out)
    dtv = {k for k in got["interposer"] | got["uprobes"] if ";_dl_allocate_tls;" in k[2]}
    assert len(dtv) <= 2 and all(k[1] < 1024 for k in dtv)
    assert sum(got["interposer"].values()) == sum(got["uprobes"].values()) > 250
    assert {k: n for k, n in got["interposer"].items() if k not in dtv} == {
        k: n for k, n in got["uprobes"].items() if k not in dtv
    }


@pytest.fixture(scope="module")
def calls_exe(cbuild):
    return cbuild("interpose_calls", "-no-pie", "-ldl")


@pytest.mark.parametrize(
    "mode,size,function",
    [
        (["threads", "2"], 101, "worker"),
        (["signal", "300"], 6006, "on_alarm"),
        (["fork"], 2002, "fork_child"),
        (["vfork"], 4004, "main"),  # (`after`, inlined: no debug information to name it)
        (["dlopen", "LIB"], 7007, "lib_calls"),
    ],
    ids=["threads", "signal", "fork", "vfork-exec", "dlopen"],
)
def test_in_process_stacks_through_threads_signals_forks_and_execs(
    calls_exe, build_dir, tmp_path, mode, size, function
):
    """--follow-forks in-process: every allocation of every process has its stack, and each of
    the workload's own calls of SIZE bytes (as many as it counts) is on a stack through
    FUNCTION: a thread's start, a signal handler (unwound across the signal frame), a forked
    child, a vfork child's exec'd program, a library dlopen'ed after the start; every frame
    named, though the children end before record reads their stacks (each process names the
    objects it loaded)."""
    if "LIB" in mode:
        lib = build_dir / "libinterpose_lib.so"
        src = WORKLOADS / "interpose_lib.c"
        subprocess.run(["gcc", "-O1", "-fno-builtin", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        mode = [str(lib) if m == "LIB" else m for m in mode]
    out = tmp_path / "t"
    proc = run_pymtrace("record", "--stacks", "--follow-forks", "--json", "-o", out, "--", calls_exe, *mode)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["via"] == "interposer" and summary["stacks_lost"] == 0 and summary["lost"] == 0
    want = sum(n for (_, kind, sz), n in truth(proc.stdout).items() if kind == B.MALLOC and sz == size)
    assert want > 0
    found = 0
    for f in summary["files"]:
        table = stacktable.read_table(stacktable.table_path(f["file"]))
        for r in B.read_file(f["file"]):
            if r.type in ALLOCS:
                assert r.stack, r
            if r.type == B.MALLOC and r.size == size:
                names = [fr.function for fr in table[r.stack].frames]
                assert function in names and not any("[unknown]" in n for n in names), names
                found += 1
    assert found == want
