"""Debian's redis-server (linked with libjemalloc.so.2) driven by redis-benchmark on 127.0.0.1:
top counts its jemalloc calls at rates consistent with the requests made, and a record of it
is replayed against glibc and jemalloc (the trace names jemalloc)."""

import json
import shutil
import signal
import socket
import subprocess
import time

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.needs import missing_or_fail
from support.prometheus import free_port
from support.top import Lines, Top

pytestmark = pytest.mark.bpf

SETS = 5000  # redis-benchmark -t set -n SETS: each SET allocates its key and value


@pytest.fixture
def redis(tmp_path):
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            missing_or_fail(f"{tool} is not installed (install.sh installs redis)")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and server.poll() is None, "redis-server did not start"
        time.sleep(0.1)
    yield server, port
    server.terminate()
    server.wait(30)


def _benchmark(port, n=SETS):
    subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set", "-n", str(n), "-c", "4", "-q"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=120,
    )


def test_top_rates_are_plausible(redis):
    server, port = redis
    top = Top("--json", "-p", server.pid, "-i", "0.5", "--no-glibc")
    try:
        top.json_doc()
        _benchmark(port)
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(server.pid)]
        assert p["allocator"] == "jemalloc" and p["allocator_traced"] is True
        calls = p["calls"]
        allocating = sum(v for k, v in calls.items() if k not in ("free", "free_null") and not k.startswith("delete"))
        # every SET allocates at least once; not hundreds of times
        assert SETS <= allocating <= 200 * SETS, calls
        assert calls["free"] > 0
        assert top.stop() == 0
    finally:
        top.kill()


def test_a_record_is_replayed_under_jemalloc(redis, tmp_path):
    server, port = redis
    out = tmp_path / "redis.trace"
    rec = subprocess.Popen(
        PYMTRACE + ["record", "-p", str(server.pid), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = Lines(rec.stderr)
    try:
        while "recording" not in err.get(300):
            pass
        _benchmark(port, 2000)
        rec.send_signal(signal.SIGINT)
        assert rec.wait(60) == 0
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    stats = json.loads(run_pymtrace("dump", "--stats", "--json", out, check=True).stdout)["stats"]
    assert stats["allocator"] == "jemalloc" and stats["records"] >= 2000
    proc = run_pymtrace("replay", out, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {c["configuration"]: c for c in json.loads(proc.stdout)["configurations"]}
    assert set(rows) == {"glibc", "jemalloc"} and all(r["error"] is None for r in rows.values()), rows
