"""Heap efficiency: live malloc bytes beside the process's RSS, and the flag for a
heap that holds far more than is allocated. tests/support/workloads/heap_frag.c: 100,000
blocks of 2,000 bytes with every other one freed (100 MB live on ~200 MB of touched heap)
against a control holding the same 100 MB unfragmented; the RSS is checked against the
kernel's own /proc/PID/status. Under jemalloc live bytes are unknown: the gap is named."""

import time

import pytest
from support.allocators import LIBS, library, start_exporter
from support.prometheus import free_port, http_get, parse_metrics
from support.top import Top, Workload

pytestmark = pytest.mark.bpf

CHUNK = 2016  # glibc's chunk for a 2,000-byte request: + 8 header bytes, 16-byte aligned


def _rss_anon(pid):
    """RssAnon from the kernel's /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def _workloads(cbuild):
    binary = cbuild("heap_frag")
    return Workload([binary, "frag"]), Workload([binary, "control"])


def test_fragmented_heap_is_flagged_and_the_control_is_not(cbuild):
    frag, control = _workloads(cbuild)
    top = Top("--json", "-p", frag.pid, "-p", control.pid, "-i", "0.5", "--view", "processes", "--view", "heap")
    try:
        top.json_doc()  # attached, counting
        results = {}
        for w in (frag, control):
            w.go()
            results[w.pid] = w.result()
        doc = top.json_after(time.monotonic())
        kernel = {w.pid: _rss_anon(w.pid) for w in (frag, control)}
        heap = {r["pid"]: r for r in doc["views"]["heap"]["rows"]}
        procs = {r["pid"]: r for r in doc["views"]["processes"]["rows"]}
        for w, flagged in ((frag, True), (control, False)):
            expected = results[w.pid]
            assert expected["live_requested"] == 100_000_000 and expected["blocks"] == 50_000
            p = doc["snapshot"]["processes"][str(w.pid)]
            assert p["live_bytes"] == expected["blocks"] * CHUNK  # 100.8 MB: the chunks of 100 MB requested
            assert abs(p["rss_anon_bytes"] - kernel[w.pid]) <= 0.02 * kernel[w.pid]
            assert p["heap_flag"] is flagged
            row = heap[w.pid]
            assert row["live_bytes"] == p["live_bytes"] and row["rss_anon_bytes"] == p["rss_anon_bytes"]
            assert row["rss_bytes"] >= row["rss_anon_bytes"]
            assert row["flag"] == ("FRAGMENTED?" if flagged else "")
            assert procs[w.pid]["rss_anon_per_live"] == row["rss_anon_per_live"]
        # ~200 MB of heap for 100 MB live; the control ~1x
        assert 1.8 <= heap[frag.pid]["rss_anon_per_live"] <= 2.2
        assert 190e6 <= heap[frag.pid]["anon_growth_bytes"] <= 215e6
        assert 0.9 <= heap[control.pid]["rss_anon_per_live"] <= 1.2
        notes = doc["views"]["heap"]["notes"]
        line = [n for n in notes if n.startswith(f"PID {frag.pid} ")]
        assert len(line) == 1 and "malloc_trim" in line[0] and "M_ARENA_MAX" in line[0] and "replay" in line[0]
        assert not [n for n in notes if n.startswith(f"PID {control.pid} ")]
        assert top.stop() == 0
        for w in (frag, control):
            assert w.finish() == 0
    finally:
        top.kill()
        frag.kill()
        control.kill()


def test_exporter_gauges(cbuild):
    frag, control = _workloads(cbuild)
    comm = "heap_frag"
    port = free_port()
    exp = start_exporter(port, "--per-call", "-p", frag.pid)
    try:
        frag.go()
        expected = frag.result()
        time.sleep(0.5)
        status, _, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        kernel = _rss_anon(frag.pid)
        assert status == 200
        m = parse_metrics(body.decode())
        key = frozenset({("comm", comm)})
        assert abs(m[("pymtrace_process_rss_anon_bytes", key)] - kernel) <= 0.02 * kernel
        assert m[("pymtrace_process_rss_bytes", key)] >= m[("pymtrace_process_rss_anon_bytes", key)]
        assert m[("pymtrace_malloc_live_bytes", key)] == expected["blocks"] * CHUNK
        assert m[("pymtrace_process_heap_flagged", key)] == 1
        assert frag.finish() == 0
    finally:
        exp.terminate()
        exp.wait(60)
        frag.kill()
        control.kill()


def test_jemalloc_fragmented_heap_is_flagged(cbuild):
    """jemalloc's blocks have no header: live bytes are the requested sizes top keeps per block
    (BPF map ms_fblocks), exact here; jemalloc's 2,048-byte size class keeps the freed
    halves of the pages resident too."""
    w = Workload(["env", f"LD_PRELOAD={library(LIBS['jemalloc'])}", cbuild("heap_frag"), "frag"])
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--view", "heap")
    try:
        top.json_doc()
        w.go()
        expected = w.result()
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        assert p["allocator"] == "jemalloc" and p["block_bytes"] == "requested"
        assert p["live_bytes"] == expected["live_requested"] == 100_000_000
        assert p["requested_bytes"] == 100_000 * 2000 and p["freed_bytes"] == 50_000 * 2000
        assert abs(p["rss_anon_bytes"] - _rss_anon(w.pid)) <= 0.02 * p["rss_anon_bytes"]
        row = {r["pid"]: r for r in doc["views"]["heap"]["rows"]}[w.pid]
        assert 1.8 <= row["rss_anon_per_live"] <= 2.3, row
        assert p["heap_flag"] is True and row["flag"] == "FRAGMENTED?"
        assert top.stop() == 0
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


def test_glibc_arena_totals_beside_the_flag(cbuild, sdt_libc):
    """On a glibc with malloc USDT probes the flagged line carries glibc's own totals: the
    main arena grew by sbrk by about the heap's size (~200 MB of 2,016-byte chunks)."""
    prefix, _libc = sdt_libc
    w = Workload(prefix + [cbuild("heap_frag"), "frag"])
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--view", "heap")
    try:
        top.json_doc()
        w.go()
        w.result()
        doc = top.json_after(time.monotonic())
        row = {r["pid"]: r for r in doc["views"]["heap"]["rows"]}[w.pid]
        assert row["flag"] == "FRAGMENTED?"
        # grown since attach; the first ~132 KiB of the heap existed before (stdio's buffers)
        assert 100_000 * CHUNK - (1 << 20) <= row["glibc_heap_bytes"] <= 100_000 * CHUNK + (8 << 20), row
        assert "glibc: main arena grew" in row["line"] and row["line"] in doc["views"]["heap"]["notes"]
        assert top.stop() == 0
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()
