"""`pymtrace top --json/--batch -p PID` against a workload with exactly known malloc-API
calls in 4 threads (tests/support/workloads/top_calls.c): every count must match exactly."""

import os
import signal
import time

import pytest
from support.schema import problems
from support.top import Top, Workload, alive, assert_probes_gone, assert_probes_installed
from support.uprobes import ProbeWatch

from pymtrace.sources.snapshot import CALLS, DELETE_CALLS, NEW_CALLS


def _expected_ok(expected):
    # the workload really exercised every C path we claim to handle (C++'s operator
    # new/delete: tests/live/test_cxx_calls.py)
    for name in CALLS:
        if name not in NEW_CALLS + DELETE_CALLS:
            assert expected["calls"][name] > 0, name
    assert expected["failed"] > 0


@pytest.mark.bpf
def test_json_counts_every_call_once_exactly(cbuild):
    w = Workload([cbuild("top_calls")])
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--no-glibc")
    try:
        first = top.json_doc()  # printed right after attach
        assert first["pids"] == [w.pid]
        assert not top.proc.poll()
        assert_probes_installed(top, w.pid)
        w.go()
        expected = w.result()
        _expected_ok(expected)
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        assert p["comm"] == "top_calls"
        assert p["calls"] == expected["calls"]
        for key in ("requested_bytes", "allocated_bytes", "freed_bytes", "failed", "size_log2"):
            assert p[key] == expected[key], key
        assert p["live_bytes"] == expected["allocated_bytes"] - expected["freed_bytes"]
        # the totals view carries the same exact numbers; other PIDs are filtered out
        rows = doc["views"]["totals"]["rows"]
        assert [r["pid"] for r in rows] == [w.pid]
        assert rows[0]["malloc"] == expected["calls"]["malloc"]
        assert rows[0]["live_bytes"] == p["live_bytes"]
        assert all(r["pid"] == w.pid for r in doc["views"]["processes"]["rows"])
        assert problems(doc["snapshot"], json_keys=True) == []  # pymtrace.sources.snapshot's schema
        # Ctrl-C: clean exit, no uprobes of ours left, the workload unharmed
        assert top.stop(signal.SIGINT) == 0
        assert_probes_gone(top, w.pid)
        assert alive(w.pid)
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


def _parse_totals(lines):
    start = lines.index("== since attach (exact counts, bytes)")
    header = lines[start + 2].split()
    rows = {}
    for line in lines[start + 4 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[int(cells[0])] = dict(zip(header, cells))
    return rows


@pytest.mark.bpf
def test_batch_totals_match_and_sigterm_detaches(cbuild):
    w = Workload([cbuild("top_calls")])
    top = Top("--batch", "-p", w.pid, "-i", "0.5", "--no-glibc", "--view", "totals", "--view", "processes")
    try:
        top.block()  # first report: attached
        top.probes_attached(3)
        w.go()
        expected = w.result()
        t = time.monotonic()
        while True:  # a report that started after the workload's calls were done
            block = top.block()
            if time.monotonic() - t > 1.2:
                break
        row = _parse_totals(block)[w.pid]
        names = {
            "malloc": "MALLOC",
            "calloc": "CALLOC",
            "realloc": "REALLOC",
            "free": "FREE",
            "free_null": "FREE(NULL)",
            "memalign": "MEMALIGN",
            "posix_memalign": "POSIX_MEMALIGN",
            "valloc": "VALLOC",
            "pvalloc": "PVALLOC",
        }
        for name, title in names.items():
            assert int(row[title]) == expected["calls"][name], name
        assert int(row["REQUESTED"]) == expected["requested_bytes"]
        assert int(row["LIVE"]) == expected["allocated_bytes"] - expected["freed_bytes"]
        assert int(row["FAILED"]) == expected["failed"]
        assert any(line.startswith("== processes") for line in block)
        assert top.stop(signal.SIGTERM) == 0
        assert_probes_gone(top, w.pid)
        assert alive(w.pid)
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.bpf
def test_ends_by_itself_after_iterations_without_leftover_probes(cbuild):
    w = Workload([cbuild("top_calls")])
    top = Top("--json", "-n", "2", "-p", w.pid, "-i", "1.5", "--no-glibc")
    try:
        top.json_doc()
        assert_probes_installed(top, w.pid)  # 1.5 s before the second (last) report
        top.json_doc()
        assert top.proc.wait(timeout=30) == 0
        assert_probes_gone(top, w.pid)
        assert alive(w.pid)
        w.go()  # the workload still works normally after the tracer left
        expected = w.result()
        assert expected["calls"]["malloc"] > 0
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.bpf
def test_system_wide_mode_counts_the_workload_exactly(cbuild):
    """Without -p: uprobes by library path for every process (the system libc and any other
    libc mapped by a running process); the workload's row is still exact."""
    w = Workload([cbuild("top_calls")])
    top = Top("--json", "-i", "0.5", "--no-glibc", "--view", "totals")
    try:
        first = top.json_doc()
        assert first["pids"] == []
        top.probes_attached(3)
        w.go()
        expected = w.result()
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        assert p["calls"] == expected["calls"]
        assert p["requested_bytes"] == expected["requested_bytes"]
        assert p["live_bytes"] == expected["allocated_bytes"] - expected["freed_bytes"]
        assert len(doc["snapshot"]["processes"]) > 1  # other processes are traced too
        assert top.stop() == 0
        top.watch.assert_gone()
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.bpf
def test_exited_process_reported_once_then_dropped(cbuild):
    """cn_proc exit events: a process that exits is reported once with "exited": true, its
    BPF state is deleted (bounded maps), and top -p ends when every traced process is gone."""
    w = Workload([cbuild("top_calls")])
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--no-glibc")
    try:
        top.json_doc()
        top.probes_attached(3)
        w.go()
        expected = w.result()
        assert w.finish() == 0
        docs = []
        while True:
            try:
                docs.append(top.json_doc(timeout=30))
            except AssertionError:  # output closed: top ended by itself
                break
        assert top.proc.wait(timeout=30) == 0
        assert "all traced processes exited" in top.stderr()
        states = [d["snapshot"]["processes"].get(str(w.pid)) for d in docs]
        final = [s for s in states if s and s["exited"]]
        assert len(final) == 1, states
        # the exit path itself frees (tcache shutdown, thread teardown): at least as many frees
        assert final[0]["calls"]["malloc"] >= expected["calls"]["malloc"]
        assert final[0]["calls"]["free"] >= expected["calls"]["free"]
        after = states[states.index(final[0]) + 1 :]
        assert all(s is None for s in after)
        top.watch.assert_gone()
    finally:
        top.kill()
        w.kill()


@pytest.mark.bpf
def test_process_on_another_libc_is_traced_through_its_own_libc(cbuild, sdt_libc):
    """-p resolves the libc the process really maps (/proc/PID/maps): the workload run on
    the probe-carrying glibc build (a different file than the system libc) is counted
    exactly, and glibc's USDT view sees that libc's probes."""
    prefix, libc_path = sdt_libc
    w = Workload(prefix + [cbuild("top_calls")])
    from pymtrace.tracee import libc

    assert libc.process_libc(w.pid) == libc_path
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--view", "totals", "--view", "glibc")
    try:
        top.json_doc()
        top.probes_attached(3)
        w.go()
        expected = w.result()
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        assert p["calls"] == expected["calls"]
        assert p["requested_bytes"] == expected["requested_bytes"]
        assert p["live_bytes"] == expected["allocated_bytes"] - expected["freed_bytes"]
        snap = doc["snapshot"]
        assert "glibc" in snap, snap.get("errors")  # the glibc source ran alongside
        assert snap["glibc"][str(w.pid)]["probes"] > 0
        assert problems(snap, json_keys=True) == []  # malloc + faults + glibc: the schema holds
        assert top.stop() == 0
        top.watch.assert_gone()
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


@pytest.mark.bpf
def test_source_api_lru_maps_stay_bounded_and_evict_the_oldest(cbuild):
    """MallocSource and FaultSource used directly (the exporter's way) with room for
    two processes, tracing four that run one after the other: the per-process maps never
    hold more than two entries, each new process is recorded exactly (the least recently
    used one is evicted, nothing is dropped: no lost events), and the evictions are counted."""
    from pymtrace.sources.faults import FaultSource
    from pymtrace.sources.malloc import MallocSource

    ws = [Workload([cbuild("top_calls")]) for _ in range(4)]
    pids = [w.pid for w in ws]
    c = MallocSource(pids=pids, max_procs=2)
    f = FaultSource(pids=pids, max_procs=2)
    watch = ProbeWatch(os.getpid())
    try:
        c.attach()
        f.attach()
        watch.wait_attached(3)
        for w in ws:
            w.go()
            expected = w.result()
            snap = c.snapshot()
            fsnap = f.snapshot()
            assert snap["processes"][w.pid]["calls"] == expected["calls"]
            assert snap["maps"]["ms_stats"]["entries"] <= 2 and snap["maps"]["ms_stats"]["max_entries"] == 2
            assert w.pid in fsnap["processes"]
            assert fsnap["maps"]["pf_totals"]["entries"] <= 2
        assert len(snap["processes"]) <= 2
        assert snap["lost"]["malloc_stats_full"] == 0
        assert fsnap["lost"]["fault_totals_full"] == 0
        assert snap["maps"]["ms_stats"]["evicted"] >= 2
        c.close()
        c.close()  # idempotent
        f.close()
        watch.assert_gone()
        assert all(w.finish() == 0 for w in ws)
    finally:
        c.close()
        f.close()
        for w in ws:
            w.kill()


def _steady(cbuild, rate, name, env=None):
    """tests/support/workloads/top_steady.c: RATE malloc+free pairs per second until stdin closes."""
    import subprocess

    proc = subprocess.Popen(
        [cbuild("top_steady"), str(rate), "0", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, int(line.split()[1])


@pytest.mark.bpf
def test_first_report_covers_one_interval_after_attach(cbuild):
    """The first report's rates are over one real interval after attach,
    not over the start-up (BPF compile) time: interval ~= -i, rate = the workload's."""
    import json

    from support.cli import run_pymtrace

    rate = 20_000
    proc, pid = _steady(cbuild, rate, "pmt-rate")
    try:
        started = time.monotonic()
        r = run_pymtrace("top", "--json", "-n", "1", "-i", "2", "-p", pid, "--no-glibc", timeout=300)
        took = time.monotonic() - started
        assert r.returncode == 0, r.stderr
        docs = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        assert len(docs) == 1
        doc = docs[0]
        assert doc["interval"] == pytest.approx(2.0, abs=0.25), (doc["interval"], took)
        rows = [row for row in doc["views"]["processes"]["rows"] if row["pid"] == pid]
        assert rows[0]["malloc_per_s"] == pytest.approx(rate, rel=0.15)
        assert rows[0]["free_per_s"] == pytest.approx(rate, rel=0.15)
        assert rows[0]["mean_size"] == 64
        # the counts since attach span at least the interval: attach happened before it
        assert doc["snapshot"]["processes"][str(pid)]["calls"]["malloc"] >= 0.85 * rate * 2
    finally:
        proc.stdin.close()
        proc.wait(30)
