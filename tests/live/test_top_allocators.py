"""top and the exporter count the malloc API wherever a process's malloc really resolves:
Debian's jemalloc, tcmalloc and mimalloc LD_PRELOADed, and an allocator defined
in the executable itself, against tests/support/workloads/top_calls.c's exact tally (built
with -DANY_ALLOCATOR: no glibc chunk header read, allocated/freed/live bytes in requested
bytes, no pvalloc). A process whose allocator
cannot be probed (a stripped static binary) is named, never shown as zero."""

import subprocess
import time

import pytest
from support.allocators import LIBS, library, start_exporter
from support.cli import PYMTRACE
from support.prometheus import free_port, http_get, parse_metrics
from support.top import Top, Workload

pytestmark = pytest.mark.bpf


def _workload(cbuild, preload=None):
    binary = cbuild("top_calls", "-DANY_ALLOCATOR")
    return Workload(["env", f"LD_PRELOAD={preload}", binary] if preload else [binary])


def _exact(p, expected):
    assert p["calls"] == expected["calls"]
    for key in ("requested_bytes", "failed", "size_log2"):
        assert p[key] == expected[key], key
    # no chunk header to read: requested sizes of the blocks allocated since attach, kept per block
    assert p["block_bytes"] == "requested"
    for key in ("allocated_bytes", "freed_bytes"):
        assert p[key] == expected[key], key
    assert p["live_bytes"] == expected["allocated_bytes"] - expected["freed_bytes"]


def _top_counts(w, name):
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--no-glibc")
    try:
        top.json_doc()
        w.go()
        expected = w.result()
        assert expected["calls"]["malloc"] > 0 and expected["failed"] > 0
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        _exact(p, expected)
        assert p["allocator"] == name and p["allocator_traced"] is True
        row = {r["pid"]: r for r in doc["views"]["processes"]["rows"]}[w.pid]
        assert row["untraced_allocator"] is None and row["live_bytes"] == p["live_bytes"]
        assert row["malloc_per_s"] is not None
        totals = {r["pid"]: r for r in doc["views"]["totals"]["rows"]}[w.pid]
        assert totals["malloc"] == expected["calls"]["malloc"]
        assert top.stop() == 0
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.parametrize("name", sorted(LIBS))
def test_top_counts_a_preloaded_allocator_exactly(cbuild, name):
    _top_counts(_workload(cbuild, library(LIBS[name])), name)


def test_top_counts_an_allocator_defined_in_the_executable(cbuild):
    w = Workload([cbuild("top_calls_own")])
    _top_counts(w, "its own malloc in top_calls_own")


@pytest.mark.parametrize("name", sorted(LIBS))
def test_exporter_counts_a_preloaded_allocator_exactly(cbuild, name):
    w = _workload(cbuild, library(LIBS[name]))
    with open(f"/proc/{w.pid}/comm") as f:
        comm = f.read().strip()
    port = free_port()
    exp = start_exporter(port, "--per-call", "-p", w.pid)
    try:
        w.go()
        expected = w.result()
        time.sleep(0.5)
        status, _, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert status == 200
        m = parse_metrics(body.decode())
        for call in ("malloc", "calloc", "realloc", "free", "memalign", "posix_memalign", "valloc"):
            got = m.get(("pymtrace_malloc_calls_total", frozenset({("comm", comm), ("call", call)})))
            assert got == expected["calls"][call], call
        gauge = "pymtrace_process_allocator_traced"
        assert m.get((gauge, frozenset({("comm", comm), ("allocator", name)}))) == 1
        live = expected["allocated_bytes"] - expected["freed_bytes"]
        assert m.get(("pymtrace_malloc_live_bytes", frozenset({("comm", comm)}))) == live
        assert w.finish() == 0
    finally:
        exp.terminate()
        exp.wait(60)
        w.kill()


def test_a_stripped_static_binary_is_named_not_zero(cbuild):
    static = cbuild("top_steady", "-static", "-s")
    plain = subprocess.Popen(
        [cbuild("top_steady"), "1000", "0", "pmt-dyn"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    st = subprocess.Popen([static, "1000", "0", "pmt-static"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = []
        for p in (plain, st):
            line = p.stdout.readline()
            assert line.startswith("ready "), line
            pids.append(int(line.split()[1]))
        top = Top("--json", "--batch", "-n", "1", "-i", "1", "-p", pids[0], "-p", pids[1], "--no-glibc")
        doc = top.json_doc()
        while "views" not in doc or not doc["views"]["processes"]["rows"]:
            doc = top.json_doc()
        rows = {r["pid"]: r for r in doc["views"]["processes"]["rows"]}
        assert rows[pids[1]]["untraced_allocator"] == "static binary (no shared libc)"
        assert rows[pids[1]]["malloc_per_s"] is None  # named, not a silent 0
        assert rows[pids[0]]["untraced_allocator"] is None
        top.stop()
        # alone, it cannot be traced at all: one line naming it
        r = subprocess.run(
            PYMTRACE + ["top", "--json", "--batch", "-n", "1", "-p", str(pids[1])], capture_output=True, text=True
        )
        assert r.returncode != 0 and "static" in r.stderr and "Traceback" not in r.stderr
    finally:
        for p in (plain, st):
            if p.poll() is None:
                p.stdin.close()
                p.wait(30)
