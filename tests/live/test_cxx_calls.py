"""C++ operator new/delete as their own call types: tests/support/workloads/
cxx_calls.cpp calls every variant a known number of times; `top --json` counts each exactly
(the malloc/free a new/delete makes inside not counted again) on glibc's libstdc++ and with
jemalloc or tcmalloc (which define their own operator new) preloaded, and `record -p` and
`record --via uprobes` map them onto dj/malloc's codes (new -> malloc, aligned new ->
memalign, delete -> free), each call once with the program's return address."""

import json
import shutil
import subprocess
import time

import pytest
from support.allocators import LIBS, library, record_workload
from support.cli import run_pymtrace
from support.cxxcalls import CALLS, STDCXX, check_records, expected_counts
from support.paths import WORKLOADS
from support.recording import text_range
from support.top import Top, Workload

from pymtrace.trace.formats import mtrace_bin as B

pytestmark = pytest.mark.bpf


def _start(binary, name):
    if name == "glibc":
        return Workload([binary]), STDCXX
    lib = library(LIBS[name])
    return Workload(["env", f"LD_PRELOAD={lib}", binary]), lib


def _check_counts(p, result, runtime, name):
    """Process entry P of top's snapshot against the workload's RESULT: each call type exact."""
    expected, frees = expected_counts(result, runtime)
    assert {c: p["calls"][c] for c in CALLS} == expected
    # operator new's own malloc (and delete's free) not counted again
    assert p["calls"]["malloc"] == 0 and p["calls"]["free"] == frees
    assert p["requested_bytes"] == result["requested_bytes"]
    if name == "glibc":  # the bytes glibc's malloc gave each new, and its free took back
        assert p["allocated_bytes"] == p["freed_bytes"] > result["requested_bytes"]
    else:  # no chunk header: each block's requested size, kept per block in BPF
        assert p["allocated_bytes"] == p["freed_bytes"] == result["requested_bytes"]
    assert p["failed"] == 0


@pytest.mark.parametrize("name", ["glibc", "jemalloc", "tcmalloc", "mimalloc"])
def test_top_counts_each_new_and_delete_once(cxx_calls, name):
    w, runtime = _start(cxx_calls, name)
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--no-glibc")
    try:
        top.json_doc()
        start = time.monotonic()
        w.go()
        result = w.result()
        docs = top.json_span(start, time.monotonic())
        doc = docs[-1]
        _check_counts(doc["snapshot"]["processes"][str(w.pid)], result, runtime, name)
        # the rates: in the interval that saw the calls (the last one on a fast machine; an
        # emulated one may take the snapshot that counts them before the test reads the tally)
        rows = [r for d in docs for r in d["views"]["processes"]["rows"] if r["pid"] == w.pid]
        assert any(r["new_per_s"] > 0 and r["delete_per_s"] > 0 for r in rows), rows
        assert top.stop() == 0
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.parametrize("name", ["glibc", "jemalloc", "tcmalloc", "mimalloc"])
def test_top_counts_two_processes_on_one_runtime_each_exactly(cxx_calls, name):
    """top -p A -p B: each process's probes are attached for it alone, and a kernel that does
    not filter return probes by process (6.1, 6.12) runs both processes' return programs at
    every return, the returns of calls nested in a new (its malloc or posix_memalign) too."""
    started = [_start(cxx_calls, name) for _ in range(2)]
    runtime = started[0][1]
    top = Top("--json", *(a for w, _ in started for a in ("-p", w.pid)), "-i", "0.5", "--no-glibc")
    try:
        top.json_doc()
        start = time.monotonic()
        for w, _ in started:
            w.go()
        results = [w.result() for w, _ in started]
        doc = top.json_span(start, time.monotonic())[-1]
        for (w, _), result in zip(started, results):
            _check_counts(doc["snapshot"]["processes"][str(w.pid)], result, runtime, name)
        assert top.stop() == 0
        assert [w.finish() for w, _ in started] == [0, 0]
    finally:
        top.kill()
        for w, _ in started:
            w.kill()


@pytest.mark.parametrize("name", ["glibc", "jemalloc", "tcmalloc", "mimalloc"])
def test_record_maps_new_and_delete_onto_malloc_codes(cxx_calls, tmp_path, name):
    """record -p: each call once, in order, with its size, alignment and the program's
    return address, whichever way its runtime's variants are probed (cxxplan: libstdc++'s
    new carried by malloc and its deletes by free, jemalloc's and mimalloc's aligned new
    carried, tcmalloc's all their own)."""
    w, _ = _start(cxx_calls, name)
    out = tmp_path / "trace"
    result = record_workload(w, out)
    c = result["calls"]
    records = list(B.read_file(out))
    types = [r.type for r in records]
    assert types.count(B.MALLOC) == c["new"] + c["new_array"] + c["new_nothrow"]
    assert types.count(B.MEMALIGN) == c["new_aligned"]
    assert types.count(B.FREE) == sum(c[k] for k in CALLS if k.startswith("delete"))
    assert len(records) == sum(c.values())  # nothing recorded twice
    check_records(records, result, cxx_calls)
    aligned = [r for r in records if r.type == B.MEMALIGN]
    assert all(r.size2 == 64 and r.ptr2 % 64 == 0 for r in aligned)
    if name == "glibc":  # chunk sizes read from glibc's headers
        assert all(r.size3 >= r.size for r in records if r.type == B.MALLOC)


@pytest.mark.parametrize("stacks", [False, True])
def test_record_via_uprobes_of_a_launched_cxx_program(cxx_calls, tmp_path, stacks):
    """`record --via uprobes -- PROG`: the same records as -p, operator new carried by its malloc
    or (--stacks, whose stack is taken at the recorded call's return) probed at its own return."""
    out = tmp_path / "trace"
    extra = ["--stacks"] if stacks else []
    r = run_pymtrace("record", "--via", "uprobes", *extra, "-o", out, "--", cxx_calls, input="xx", timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    lo, hi = text_range(cxx_calls)  # the program's calls, not its libraries' at start-up
    check_records([rec for rec in B.read_file(out) if lo <= rec.caller < hi], result, cxx_calls)


def test_record_stacks_in_process_of_a_cxx_program(cxx_calls, tmp_path):
    """`record --stacks -- PROG` in-process: the same records, every allocation with its stack,
    also libstdc++'s pool allocated by its initializer before the interposer's constructor ran
    (the ring and its stack table are made at that first call, libunwind loaded then)."""
    out = tmp_path / "trace"
    r = run_pymtrace("record", "--stacks", "--json", "-o", out, "--", cxx_calls, input="xx", timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stderr.strip().splitlines()[-1])
    assert summary["via"] == "interposer" and summary["stacks_lost"] == 0 and summary["command_exit_status"] == 0
    result = json.loads(r.stdout.splitlines()[-1])
    records = list(B.read_file(out))
    lo, hi = text_range(cxx_calls)
    check_records([rec for rec in records if lo <= rec.caller < hi], result, cxx_calls)
    from pymtrace.trace import stacktable

    table = stacktable.read_table(stacktable.table_path(str(out)))
    allocs = [rec for rec in records if rec.type in (B.MALLOC, B.MEMALIGN)]
    assert all(rec.stack for rec in allocs)
    # the first of all: libstdc++'s initializer's, called by the loader (named by module: ld.so
    # may have no symbols)
    first = [f.module for f in table[allocs[0].stack].frames]
    assert any("/ld-linux" in m for m in first) and any("/libstdc++" in m for m in first), first
    assert all(";main;" in table[rec.stack].folded() for rec in allocs if lo <= rec.caller < hi)


@pytest.mark.parametrize("extra", [["--via", "uprobes"], ["--stacks"]], ids=["uprobes", "in-process-stacks"])
def test_an_exception_out_of_operator_new_reaches_the_program(tmp_path, extra):
    """A carried operator new has no return probe, whose rewritten return address would stop the
    unwinder (std::terminate): under `record --via uprobes` the program catches its bad_alloc,
    and each failed new is recorded as a malloc that returned NULL, at the program's call; in
    -process with --stacks the exception unwinds through the wrapper with libunwind loaded."""
    from support.needs import missing_or_fail

    if shutil.which("g++") is None:
        missing_or_fail("g++ is not installed")
    prog = tmp_path / "bad_alloc"
    subprocess.run(["g++", "-O1", "-no-pie", "-o", prog, WORKLOADS / "cxx_bad_alloc.cpp"], check=True)
    out = tmp_path / "trace"
    r = run_pymtrace("record", *extra, "-o", out, "--", prog, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["caught", "3"]
    lo, hi = text_range(str(prog))
    failed = [rec for rec in B.read_file(out) if rec.type == B.MALLOC and rec.size == 1 << 62]
    # (in-process the failed new's own malloc is what is recorded: its caller is the runtime's)
    assert [(rec.ptr2, lo <= rec.caller < hi) for rec in failed] == [(0, "--stacks" not in extra)] * 3
