"""System-wide `pymtrace top` and the exporter against libc files planted by an
unprivileged user: any user can map a file named libc.so.6;
a non-ELF or truncated one must be skipped with a note, never stop the others."""

import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.prometheus import free_port, http_get, parse_metrics

NOBODY = 65534


def _as_nobody(argv):
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to run a process as an unprivileged user")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


@pytest.fixture
def planted(cbuild):
    """Two processes of user nobody, each mapping a bad libc.so.6 of its own (not ELF;
    a truncated copy of the real libc), plus one ordinary process allocating at a known
    rate. Yields (bad paths, the ordinary process's PID)."""
    from pymtrace.tracee import libc

    exe = cbuild("map_as_libc")
    steady = cbuild("top_steady")
    top = tempfile.mkdtemp(prefix="pymtrace-planted-")
    os.chmod(top, 0o755)
    shutil.copy(exe, os.path.join(top, "map_as_libc"))
    os.chmod(os.path.join(top, "map_as_libc"), 0o755)
    paths = []
    for name, data in (
        ("notelf", b"this is not an ELF file\n" * 100),
        ("truncated", open(libc.system_libc(), "rb").read()[:16384]),
    ):
        d = os.path.join(top, name)
        os.mkdir(d)
        path = os.path.join(d, "libc.so.6")
        with open(path, "wb") as f:
            f.write(data)
        for p in (d, path):
            os.chown(p, NOBODY, NOBODY)
        paths.append(path)
    procs = []
    try:
        for path in paths:
            p = subprocess.Popen(
                _as_nobody([os.path.join(top, "map_as_libc"), path]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            line = p.stdout.readline()
            assert line.startswith("ready "), line
            pid = int(line.split()[1])
            assert os.stat(f"/proc/{pid}").st_uid == NOBODY
            assert libc.process_libc(pid) == path  # pymtrace takes it for this process's libc
        w = subprocess.Popen(
            [steady, "5000", "0", "pmt-steady"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(w)
        line = w.stdout.readline()
        assert line.startswith("ready "), line
        yield paths, int(line.split()[1])
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(top, ignore_errors=True)


def _assert_noted(text, paths):
    for path in paths:
        assert re.search(rf"skipped .*{re.escape(path)} \(mapped by PID \d+", text), (path, text)
    assert "Traceback" not in text


@pytest.mark.bpf
def test_top_system_wide_skips_planted_libcs(planted):
    paths, pid = planted
    r = run_pymtrace("top", "--batch", "-n", "1", "-i", "1", "--view", "processes", "--view", "glibc", timeout=300)
    assert r.returncode == 0, r.stderr
    _assert_noted(r.stderr, paths)
    assert r.stderr.count("skipped") == 1  # one note, shown once
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] == [str(pid)]]
    assert rows and rows[0][1] == "pmt-steady", r.stdout
    assert float(rows[0][2].rstrip("k")) > 0  # its MALLOC/s: the good libc is traced
    from pymtrace.tracee import libc

    if not libc.malloc_probes(libc.system_libc()):  # view 4 says why it is empty
        glibc = r.stdout[r.stdout.index("== glibc internals") :]
        assert "0 processes with probes, 0 without" not in glibc
        assert f"the libc {libc.system_libc()} has no malloc USDT probes" in glibc, glibc


@pytest.mark.bpf
def test_exporter_skips_planted_libcs(planted):
    paths, pid = planted
    port = free_port()
    help_text = run_pymtrace("exporter", "--help").stdout
    mode = ["--per-call"] if "--per-call" in help_text else []  # the malloc uprobes, whatever the default
    proc = subprocess.Popen(
        PYMTRACE + ["exporter", "--listen", f"127.0.0.1:{port}", "--no-bpf-stats", *mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        err = ""
        deadline = time.time() + 300
        while time.time() < deadline:
            line = proc.stderr.readline()
            err += line
            if "serving" in line or (not line and proc.poll() is not None):
                break
        assert "serving" in err, err
        _assert_noted(err, paths)
        time.sleep(1.0)
        status, _, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert status == 200
        m = parse_metrics(body.decode())
        calls = m.get(("pymtrace_malloc_calls_total", frozenset({("comm", "pmt-steady"), ("call", "malloc")})))
        assert calls and calls > 0, "the ordinary process's malloc calls are counted"
        assert m.get(("pymtrace_exporter_collector_up", frozenset({("collector", "malloc")}))) == 1
    finally:
        proc.terminate()
        proc.wait(60)
