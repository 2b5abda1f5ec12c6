"""Processes whose malloc is not glibc's: the test workload run with Debian's
libjemalloc.so.2 preloaded. top, the exporter and record count jemalloc's calls
(exact counts: test_top_allocators.py, test_record_allocators.py) and name
the allocator; `record -- CMD` follows the command's exec into it."""

import json
import os
import subprocess
import time

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.prometheus import free_port, http_get, parse_metrics
from support.recording import text_range

from pymtrace.trace.formats import mtrace_bin as B

pytestmark = pytest.mark.bpf

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


@pytest.fixture
def jemalloc():
    if not os.path.exists(JEMALLOC):
        pytest.fail(f"{JEMALLOC} is missing: install.sh installs Debian's libjemalloc2")
    return JEMALLOC


def _steady(cbuild, name, preload=None, seconds=0, rate=2000):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    proc = subprocess.Popen(
        [cbuild("top_steady"), str(rate), str(seconds), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, int(line.split()[1])


def _stop(proc):
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(30)


def test_record_pid_records_a_jemalloc_process(cbuild, jemalloc, tmp_path):
    """record -p on a jemalloc process records its calls (it probes jemalloc; exact counts:
    test_record_allocators.py), and leaves it running."""
    proc, pid = _steady(cbuild, "pmt-jemalloc", preload=jemalloc)
    try:
        out = tmp_path / "trace"
        r = run_pymtrace("record", "-p", pid, "-o", out, "--duration", "1", timeout=300)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr and "warning" not in r.stderr
        with open(out, "rb") as f:
            assert B.allocator_of(f.read(64)) == "jemalloc"
        mallocs = [rec for rec in B.read_file(out) if rec.type == B.MALLOC and rec.size == 64]
        assert mallocs and all(rec.size3 == 0 for rec in mallocs)
        assert proc.poll() is None  # untouched
    finally:
        _stop(proc)


def test_record_cmd_records_a_command_on_jemalloc(cbuild, jemalloc, tmp_path):
    """`record -- env LD_PRELOAD=jemalloc PROG` records PROG's calls: 2000 malloc+free pairs
    from its call site, and no warning that they are not recorded; the same command on glibc's
    malloc likewise."""
    prog = cbuild("top_steady", "-no-pie")
    lo, hi = text_range(prog)
    for preload in (["env", f"LD_PRELOAD={jemalloc}"], []):
        out = tmp_path / f"trace{len(preload)}"
        r = run_pymtrace("record", "-o", out, "--", *preload, prog, "2000", "1", timeout=300)
        assert r.returncode == 0, r.stderr
        assert "warning" not in r.stderr
        made = int(r.stdout.split("count ")[1].split()[0])  # top_steady's malloc(64)+free pairs
        own = [rec for rec in B.read_file(out) if lo <= rec.caller < hi]
        assert made >= 1000
        assert sum(rec.type == B.MALLOC and rec.size == 64 for rec in own) == made
        assert sum(rec.type == B.FREE for rec in own) == made


def test_top_row_names_the_counted_allocator(cbuild, jemalloc):
    je, je_pid = _steady(cbuild, "pmt-jemalloc", preload=jemalloc)
    gl, gl_pid = _steady(cbuild, "pmt-glibc")
    try:
        r = run_pymtrace(
            "top", "--batch", "--json", "-n", "1", "-i", "1", "-p", je_pid, "-p", gl_pid, "--no-glibc", timeout=300
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout.splitlines()[0])
        rows = {row["pid"]: row for row in doc["views"]["processes"]["rows"]}
        assert rows[je_pid]["untraced_allocator"] is None  # counted: no "not traced" note
        assert rows[je_pid]["malloc_per_s"] == pytest.approx(2000, rel=0.25)
        # jemalloc's blocks carry no header: their requested sizes are kept per block, so live bytes
        # are exact (each malloc(64) is freed at once: 0, or one block in flight)
        assert rows[je_pid]["live_bytes"] in (0, 64)
        assert rows[gl_pid]["untraced_allocator"] is None
        assert rows[gl_pid]["malloc_per_s"] == pytest.approx(2000, rel=0.25)
        snap = doc["snapshot"]["processes"]
        assert snap[str(je_pid)]["allocator"] == "jemalloc" and snap[str(je_pid)]["allocator_traced"] is True
        assert snap[str(gl_pid)]["allocator"] == "glibc" and snap[str(gl_pid)]["allocator_traced"] is True
    finally:
        _stop(je)
        _stop(gl)


def test_exporter_gauge_names_each_processes_allocator(cbuild, jemalloc):
    je, je_pid = _steady(cbuild, "pmt-jemalloc", preload=jemalloc)
    gl, gl_pid = _steady(cbuild, "pmt-glibc")
    port = free_port()
    mode = ["--per-call"] if "--per-call" in run_pymtrace("exporter", "--help").stdout else []
    exp = subprocess.Popen(
        PYMTRACE
        + ["exporter", "--listen", f"127.0.0.1:{port}", "--no-bpf-stats", "-p", str(je_pid), "-p", str(gl_pid), *mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            line = exp.stderr.readline()
            if "serving" in line or (not line and exp.poll() is not None):
                break
        assert "serving" in line, line
        time.sleep(1.0)
        status, _, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert status == 200
        m = parse_metrics(body.decode())
        gauge = "pymtrace_process_allocator_traced"
        assert m.get((gauge, frozenset({("comm", "pmt-jemalloc"), ("allocator", "jemalloc")}))) == 1
        assert m.get((gauge, frozenset({("comm", "pmt-glibc"), ("allocator", "glibc")}))) == 1
        assert m.get(("pymtrace_malloc_calls_total", frozenset({("comm", "pmt-glibc"), ("call", "malloc")}))) > 0
        assert m.get(("pymtrace_malloc_calls_total", frozenset({("comm", "pmt-jemalloc"), ("call", "malloc")}))) > 0
    finally:
        exp.terminate()
        exp.wait(60)
        _stop(je)
        _stop(gl)
