"""`pymtrace run` / `pymtrace summary` on real BPF: the end-of-run report (the model without BPF:
tests/unit/test_glibc_report.py)."""

import json
import os
import signal
import subprocess

import pytest
from support.cli import PYMTRACE, run_pymtrace, workload_facts

from pymtrace.tracee import libc


def _run_json(*argv, env=None):
    proc = run_pymtrace("run", "--json", "--", *argv, env=env)
    assert proc.returncode == 0, proc.stderr
    start = proc.stdout.index("{\n")
    return json.loads(proc.stdout[start:]), proc.stdout[:start]


@pytest.mark.bpf
def test_run_sbrk_numbers_exact(sdt_libc, cbuild):
    prefix, path = sdt_libc
    doc, out = _run_json(*prefix, cbuild("glibc_sbrk"), "8", "200000")
    f = workload_facts(out)
    start, grown, final = (int(f[k][0][0], 16) for k in ("start_brk", "grown_brk", "final_brk"))
    assert doc["libc"] == path and doc["probes"] >= 29 and doc["lost_events"] == 0
    s = doc["glibc"]["sbrk"]
    assert s["grown_bytes"] == grown - start
    assert s["trimmed_bytes"] == grown - final
    assert s["net_bytes"] == final - start
    assert s["chain_breaks"] == 0 and s["failed"] == 0
    assert doc["collector"]["sbrk_bytes"] == grown - start  # BPF maps agree with the stream
    assert doc["collector"]["sbrk_trimmed_bytes"] == grown - final
    assert [(t["param"], t["old"], t["new"], t["cause"]) for t in doc["glibc"]["thresholds"]] == [
        ("mmap_threshold", 131072, 4 << 20, "mallopt"),
        ("top_pad", 131072, 0, "mallopt"),
        ("trim_threshold", 131072, 65536, "mallopt"),
    ]
    assert doc["glibc"]["arenas"] == [] and doc["glibc"]["heaps"] == []
    assert all(r["count"] == 0 for r in doc["glibc"]["retries"].values())
    assert doc["glibc"]["tcache_double_free_scans"] == 0
    # 8 x 200000 bytes written in the main heap: at least that many pages faulted there
    assert doc["faults"]["regions"]["[heap]"] >= 8 * 200000 // 4096


@pytest.mark.bpf
def test_run_arenas_threads_and_heaps(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    doc, out = _run_json(*prefix, cbuild("glibc_arenas"), "new", "3")
    f = workload_facts(out)
    creators = {int(t) for _, t in f["tid"]}
    reusers = {int(t) for _, t in f["reuse_tid"]}
    g = doc["glibc"]
    created = [a for a in g["arenas"] if a["created_by"] is not None]
    assert g["arenas_created"] == 3 and {a["created_by"] for a in created} == creators
    for a in created:  # each arena: its creator, then one thread from the free list
        assert len(a["threads"]) == 2 and a["created_by"] in a["threads"]
        assert (set(a["threads"]) - {a["created_by"]}) <= reusers and a["from_free_list"] == 1
        assert a["size_request"] == 640 and not a["main"]
    assert g["heap_totals"]["created"] == 4 and g["heap_totals"]["freed"] == 1 and g["heap_totals"]["live"] == 3
    freed = [h for h in g["heaps"] if h["freed"]]
    tid0 = int(f["tid"][[i for i, _ in f["tid"]].index("0")][1])
    assert len(freed) == 1 and freed[0]["grow"] > 0
    owner = [h for h in g["heaps"] if h["created_by"] == tid0]
    assert len(owner) == 2  # thread 0 made its arena's heap and the second one
    for h in g["heaps"]:
        assert h["max_size"] >= h["final_size"] and h["max_size"] >= h["initial_size"]
    assert g["heap_totals"]["live_bytes"] == doc["collector"]["heap_bytes"]
    assert g["arena_lock_waits"] == []


@pytest.mark.bpf
def test_run_lock_waits_on_main_arena(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    doc, out = _run_json(*prefix, cbuild("glibc_arenas"), "wait", "2")
    waiters = {int(t) for _, t in workload_facts(out)["wait_tid"]}
    g = doc["glibc"]
    assert {w["tid"]: w["waits"] for w in g["arena_lock_waits"]} == {t: 1 for t in waiters}
    assert g["arena_lock_waits_total"] == 2
    (arena,) = g["arenas"]
    assert arena["main"] is True and set(arena["threads"]) == waiters and arena["waits"] == 2
    assert [w["arenas"] for w in g["arena_lock_waits"]] == [[arena["arena"]]] * 2


@pytest.mark.bpf
def test_run_threshold_history_with_causes(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.tcache_count=5")
    doc, out = _run_json(*prefix, cbuild("glibc_params"), "dyn", env=env)
    f = workload_facts(out)
    (m1, t1), (m2, t2) = ([int(x) for x in f[k][0]] for k in ("dyn1", "dyn2"))
    hist = [(t["param"], t["old"], t["new"], t["cause"]) for t in doc["glibc"]["thresholds"]]
    assert hist == [
        ("tcache_count", 7, 5, "tunable"),
        ("mmap_threshold", None, m1, "dynamic"),
        ("trim_threshold", None, t1, "dynamic"),
        ("mmap_threshold", m1, m2, "dynamic"),
        ("trim_threshold", t1, t2, "dynamic"),
        ("mmap_threshold", m2, 2 << 20, "mallopt"),
    ]
    assert doc["glibc"]["final_params"]["mmap_threshold"] == {"value": 2 << 20, "cause": "mallopt"}
    assert doc["collector"]["dyn_threshold_changes"] == 2


@pytest.mark.bpf
def test_run_retries_and_tcache_scans(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    doc, out = _run_json(*prefix, cbuild("glibc_retry"))
    big = int(workload_facts(out)["malloc"][0][0])
    r = doc["glibc"]["retries"]
    # malloc fails, calloc, realloc (whose fallback malloc fails again), memalign
    assert r["malloc"] == {"count": 2, "bytes": 2 * big}
    assert r["calloc"] == {"count": 1, "bytes": big}
    assert r["realloc"] == {"count": 1, "bytes": big}
    assert r["memalign"] == {"count": 1, "bytes": big}
    assert r["arena"]["count"] == 4
    assert doc["glibc"]["sbrk"]["failed"] >= 4
    doc, out = _run_json(*prefix, cbuild("glibc_tcache"), "fake", "4")
    assert doc["glibc"]["tcache_double_free_scans"] == 4
    assert [d["tc_idx"] for d in doc["glibc"]["tcache_double_free"]] == [0, 1, 2, 3]


@pytest.mark.bpf
def test_run_faults_by_region(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    doc, out = _run_json(*prefix, cbuild("glibc_faults"), "2048", "8192", "2048")
    reg = doc["faults"]["regions"]
    pages = lambda kb: kb * 1024 // 4096  # noqa: E731
    assert pages(2048) <= reg["[heap]"] <= pages(2048) + 16
    assert pages(2048) <= reg["arena heaps"] <= pages(2048) + 16
    assert pages(8192) <= reg["mmapped chunks"] <= pages(8192) + 64
    assert reg["files"] > 0
    assert any(name.endswith("libc.so.6") for name in doc["faults"]["files"])
    assert doc["faults"]["total"] == sum(reg.values())


@pytest.mark.bpf
def test_run_faults_calloc_versus_malloc_memset(sdt_libc, cbuild):
    """The zero-page story: calloc of a fresh mmapped chunk touches nothing (it is known
    zero), malloc + memset(0) faults every page in."""
    prefix, _ = sdt_libc
    pages = 8192 * 1024 // 4096
    calloc_doc, _ = _run_json(*prefix, cbuild("glibc_faults"), "0", "8192", "0", "calloc")
    memset_doc, _ = _run_json(*prefix, cbuild("glibc_faults"), "0", "8192", "0", "memset")
    assert calloc_doc["faults"]["regions"]["mmapped chunks"] < 64
    assert pages <= memset_doc["faults"]["regions"]["mmapped chunks"] <= pages + 64


@pytest.mark.bpf
def test_run_on_libc_without_probes_reports_faults(cbuild):
    system = libc.system_libc()
    if libc.malloc_probes(system):
        pytest.skip("the system libc carries probes")
    proc = run_pymtrace("run", "--", cbuild("glibc_faults"), "1024", "4096", "1024")
    assert proc.returncode == 0, proc.stderr
    assert f"libc {system} has no USDT probes" in proc.stdout
    assert "glibc allocator internals unavailable" in proc.stdout
    doc, _ = _run_json(cbuild("glibc_faults"), "1024", "4096", "1024")
    assert doc["probes"] == 0 and "has no USDT probes" in doc["reason"] and "glibc" not in doc
    reg = doc["faults"]["regions"]
    assert 256 <= reg["[heap]"] <= 256 + 16 and 1024 <= reg["mmapped chunks"] <= 1024 + 64
    # no heap probes here: arena heaps are recognised by glibc's PROT_NONE 64/128 MiB reservation
    # (MAP_NORESERVE in Debian 12's glibc 2.36, not in 13's 2.41)
    assert 256 <= reg["arena heaps"] <= 256 + 16


@pytest.mark.bpf
def test_summary_of_running_pid_until_it_exits(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    work = subprocess.Popen(
        prefix + [cbuild("glibc_idle"), "5", "100000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert work.stdout.readline().startswith("ready")
        tracer = subprocess.Popen(
            PYMTRACE + ["summary", "--json", "-p", str(work.pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = tracer.stderr.readline()
        while line and "tracing PID" not in line:
            line = tracer.stderr.readline()
        assert "tracing PID" in line
        work.stdin.write("go\n")
        work.stdin.flush()
        facts = dict(ln.split() for ln in work.stdout.read().splitlines())
        work.wait(timeout=30)
        out, err = tracer.communicate(timeout=60)
    finally:
        work.kill()
    assert tracer.returncode == 0, err
    doc = json.loads(out)
    assert doc["pid"] == work.pid
    assert doc["glibc"]["sbrk"]["grown_bytes"] == int(facts["after_brk"], 16) - int(facts["before_brk"], 16)
    assert [(t["param"], t["new"], t["cause"]) for t in doc["glibc"]["thresholds"]] == [("top_pad", 0, "mallopt")]


@pytest.mark.bpf
def test_summary_ctrl_c_reports(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    work = subprocess.Popen(prefix + [cbuild("glibc_idle")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout.readline().startswith("ready")
        tracer = subprocess.Popen(
            PYMTRACE + ["summary", "-p", str(work.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = tracer.stderr.readline()
        while line and "tracing PID" not in line:
            line = tracer.stderr.readline()
        tracer.send_signal(signal.SIGINT)
        out, err = tracer.communicate(timeout=60)
        assert work.poll() is None  # the target keeps running
    finally:
        work.kill()
    assert tracer.returncode == 0, err
    assert f"pymtrace report for PID {work.pid}" in out and "Main arena (sbrk)" in out
