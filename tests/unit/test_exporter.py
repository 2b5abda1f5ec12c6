"""The exporter without BPF: aggregation, HTTP robustness, TLS + basic auth, a real
Prometheus scraping it, promtool on a scrape and on exporters/, the dashboard's metric names.

The BPF end-to-end tests (real collectors, C workload, churn) are in test_exporter_bpf.py;
the helpers both use (Prometheus harness, scraping) are in tests/support/prometheus.py.
"""

import base64
import json
import pathlib
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from support.prometheus import Prometheus, http_get, metric_names, need_tool, parse_metrics, sample

from pymtrace.commands import exporter
from pymtrace.errors import PymtraceError
from pymtrace.sinks import webconfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPORTERS = ROOT / "exporters"


class FakeSource:
    """Stands in for a collector: snapshot() returns whatever the test put in .snap."""

    name = "fake"

    def __init__(self, snap=None):
        self.snap = snap or {"processes": {}, "slab": {}, "lost": {}}
        self.calls = 0

    def snapshot(self):
        self.calls += 1
        return json.loads(json.dumps(self.snap))  # JSON round trip, like a real consumer


def proc_entry(pid, comm, malloc=0, free=0, requested=0, live=0, sizes=None, faults=(0, 0)):
    return {
        "pid": pid,
        "comm": comm,
        "calls": {"malloc": malloc, "free": free},
        "requested_bytes": requested,
        "allocated_bytes": requested,
        "freed_bytes": requested - live,
        "live_bytes": live,
        "failed": 0,
        "size_log2": sizes or [],
        "faults_user": faults[0],
        "faults_kernel": faults[1],
    }


class ServedExporter:
    """An exporter HTTP server in this process over the given sources (a thread)."""

    def __init__(self, sources, web=None, timeout=2.0, aggregator=None, label_by="comm", **kw):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.agg = aggregator or exporter.Aggregator(label_by=label_by, alive=lambda pid: True)
        self.collector = exporter.ExporterCollector(sources, self.agg, None, label_by=label_by)
        self.registry.register(self.collector)
        self.server = exporter.make_server(
            ("127.0.0.1", 0),
            self.registry,
            web=web,
            timeout=timeout,
            index_html=exporter.INDEX.format(mode="full", label=label_by, version="t"),
            **kw,
        )
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()
        scheme = "https" if web and web.ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served():
    made = []

    def make(*a, **kw):
        s = ServedExporter(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# ---------------------------------------------------------------- aggregation


def test_series_keyed_by_comm_sum_processes_and_stay_monotonic_when_they_exit():
    t = [0.0]
    agg = exporter.Aggregator(grace=60, alive=lambda pid: pid in alive)
    alive = {1, 2, 3}
    procs = {
        1: proc_entry(1, "web", malloc=10, requested=100, live=50),
        2: proc_entry(2, "web", malloc=5, requested=40, live=8),
        3: proc_entry(3, "db", malloc=7, requested=70, live=70),
    }
    agg.update(procs, now=t[0])
    s = agg.series()
    assert s["web"]["counters"][("calls", "malloc")] == 15
    assert s["web"]["counters"]["requested_bytes"] == 140
    assert s["web"]["gauges"]["live_bytes"] == 58
    assert s["db"]["counters"][("calls", "malloc")] == 7
    assert not any(lb.isdigit() for lb in s)  # never a PID label by default

    # pid 1 exits and leaves the collector's map: its calls stay counted, its live bytes go
    alive.discard(1)
    del procs[1]
    procs[2] = proc_entry(2, "web", malloc=6, requested=50, live=8)
    agg.update(procs, now=1.0)
    s = agg.series()
    assert s["web"]["counters"][("calls", "malloc")] == 16
    assert s["web"]["counters"]["requested_bytes"] == 150
    assert s["web"]["gauges"]["live_bytes"] == 8

    # exec: pid 3 becomes "worker"; "db" keeps what it did, "worker" counts from there
    procs[3] = proc_entry(3, "worker", malloc=9, requested=90, live=70)
    agg.update(procs, now=2.0)
    s = agg.series()
    assert s["db"]["counters"][("calls", "malloc")] == 7
    assert s["worker"]["counters"][("calls", "malloc")] == 2

    # PID reuse: pid 2's counters restart from zero under the same comm -> no decrease
    procs[2] = proc_entry(2, "web", malloc=1, requested=10, live=10)
    agg.update(procs, now=3.0)
    assert agg.series()["web"]["counters"][("calls", "malloc")] == 17

    # everything of "web" gone: the series disappears after the grace period, not before
    alive.discard(2)
    del procs[2]
    agg.update(procs, now=4.0)
    assert "web" in agg.series()
    agg.update(procs, now=4.0 + 59)
    assert "web" in agg.series()
    agg.update(procs, now=4.0 + 61)
    assert "web" not in agg.series() and "db" not in agg.series()
    assert "worker" in agg.series()
    assert "web" not in agg.retired


def test_a_process_dropped_by_one_collector_before_another_is_counted_once():
    alive = {1}
    agg = exporter.Aggregator(alive=lambda pid: pid in alive)
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 3}, "faults_user": 5}}, now=0)
    alive.clear()
    # the fault collector already forgot the exited process, the malloc collector not yet
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 3}, "exited": True}}, now=1)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 3 and c["faults_user"] == 5
    agg.update({}, now=2)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 3 and c["faults_user"] == 5
    assert agg.pids == {}


def test_an_lru_evicted_entry_recreated_keeps_the_counters_monotonic():
    """The malloc map (LRU) evicted a live process's entry and re-created it at its next
    call: its malloc counters restart from 0, its fault counters (another map) do not.
    The series adds the restarted counters to what was counted before, and counts the
    faults once."""
    agg = exporter.Aggregator(alive=lambda pid: True)
    agg.update(
        {1: {"pid": 1, "comm": "x", "calls": {"malloc": 100}, "requested_bytes": 1000, "faults_user": 50}}, now=0
    )
    # evicted from the malloc map: only the fault collector reports it for a while
    agg.update({1: {"pid": 1, "comm": "x", "faults_user": 60}}, now=1)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 100 and c["faults_user"] == 60
    # re-created by its next calls: counted from 0 again, on top of the 100
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 4}, "requested_bytes": 40, "faults_user": 70}}, now=2)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 104 and c["requested_bytes"] == 1040 and c["faults_user"] == 70
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 9}, "requested_bytes": 90, "faults_user": 75}}, now=3)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 109 and c["requested_bytes"] == 1090 and c["faults_user"] == 75


def test_label_by_pid_is_capped_with_other_and_other_never_decreases():
    alive = set(range(1, 11))
    agg = exporter.Aggregator(label_by="pid", max_series=3, grace=5, alive=lambda pid: pid in alive)
    procs = {p: proc_entry(p, "w", malloc=p * 10) for p in range(1, 11)}
    agg.update(procs, now=0)
    s = agg.series()
    assert set(s) == {"10", "9", "8", "other"}  # the three busiest get their own series
    assert s["other"]["counters"][("calls", "malloc")] == sum(p * 10 for p in range(1, 8))
    total = sum(v["counters"][("calls", "malloc")] for v in s.values())
    assert total == sum(p * 10 for p in range(1, 11))
    # pid 10 exits; after the grace period its place goes to a process from "other",
    # which continues from its current value while "other" keeps what it had
    alive.discard(10)
    del procs[10]
    prev_other = s["other"]["counters"][("calls", "malloc")]
    for p in procs:
        procs[p] = proc_entry(p, "w", malloc=p * 10 + 1)
    for now in (1, 3, 7, 8):
        agg.update(procs, now=now)
        s = agg.series()
        other = s["other"]["counters"][("calls", "malloc")]
        assert other >= prev_other
        prev_other = other
        assert len(s) <= 4
    assert "10" not in s and "7" in s


def test_comm_and_pid_filters():
    agg = exporter.Aggregator(comm="^ngi", alive=lambda pid: True)
    agg.update({1: proc_entry(1, "nginx", malloc=1), 2: proc_entry(2, "bash", malloc=1)}, now=0)
    assert set(agg.series()) == {"nginx"}
    agg = exporter.Aggregator(pids=[2], alive=lambda pid: True)
    agg.update({1: proc_entry(1, "nginx", malloc=1), 2: proc_entry(2, "bash", malloc=1)}, now=0)
    assert set(agg.series()) == {"bash"}


def test_exposition_names_types_histogram_and_glibc():
    src = FakeSource(
        {
            "processes": {
                "7": proc_entry(
                    7, "app", malloc=3, free=2, requested=1000, live=500, sizes=[0, 1, 0, 2], faults=(11, 4)
                )
            },
            "slab": {"kmalloc-64": {"allocs": 9, "frees": 4, "bytes_alloc": 576, "bytes_req": 500}},
            "glibc": {
                "7": {
                    "arenas": 3,
                    "heaps": 2,
                    "heap_bytes": 135168,
                    "sbrk_bytes": 200704,
                    "mmap_threshold": 65536,
                    "trim_threshold": 131072,
                    "arena_lock_waits": 5,
                    "lock_waits": {"7": 2, "8": 3},
                    "retries": {"malloc": 1, "arena": 2},
                    "sbrk_trimmed_bytes": 4096,
                }
            },
            "lost": {"ringbuf": 5},
        }
    )
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(exporter.ExporterCollector([src], exporter.Aggregator(alive=lambda p: True)))
    text = generate_latest(reg).decode()
    m = parse_metrics(text)
    assert sample(m, "pymtrace_malloc_calls_total", comm="app", call="malloc") == 3
    assert sample(m, "pymtrace_malloc_calls_total", comm="app", call="free") == 2
    assert sample(m, "pymtrace_malloc_requested_bytes_total", comm="app") == 1000
    assert sample(m, "pymtrace_malloc_live_bytes", comm="app") == 500
    # BPF log2 buckets ([0] size 0, [i] sizes 2**(i-1) .. 2**i - 1) -> cumulative le buckets
    assert sample(m, "pymtrace_malloc_size_bytes_bucket", comm="app", le="0.0") == 0
    assert sample(m, "pymtrace_malloc_size_bytes_bucket", comm="app", le="1.0") == 1
    assert sample(m, "pymtrace_malloc_size_bytes_bucket", comm="app", le="3.0") == 1
    assert sample(m, "pymtrace_malloc_size_bytes_bucket", comm="app", le="7.0") == 3
    assert sample(m, "pymtrace_malloc_size_bytes_bucket", comm="app", le="+Inf") == 3
    assert sample(m, "pymtrace_malloc_size_bytes_count", comm="app") == 3
    assert sample(m, "pymtrace_page_faults_total", comm="app", mode="user") == 11
    assert sample(m, "pymtrace_page_faults_total", comm="app", mode="kernel") == 4
    assert sample(m, "pymtrace_slab_allocations_total", cache="kmalloc-64") == 9
    assert sample(m, "pymtrace_slab_frees_total", cache="kmalloc-64") == 4
    assert sample(m, "pymtrace_slab_allocated_bytes_total", cache="kmalloc-64") == 576
    assert sample(m, "pymtrace_glibc_arenas", comm="app") == 3
    assert sample(m, "pymtrace_glibc_mmap_threshold_bytes", comm="app") == 65536
    assert sample(m, "pymtrace_glibc_arena_lock_waits_total", comm="app") == 5
    assert sample(m, "pymtrace_glibc_retries_total", comm="app") == 3
    assert sample(m, "pymtrace_glibc_sbrk_grown_bytes_total", comm="app") == 200704
    assert sample(m, "pymtrace_glibc_sbrk_trimmed_bytes_total", comm="app") == 4096
    assert sample(m, "pymtrace_exporter_events_lost_total", cause="ringbuf") == 5
    assert sample(m, "pymtrace_exporter_scrape_duration_seconds") is not None
    for name in metric_names(text):
        assert name.startswith("pymtrace_"), name
        assert not name.startswith(("pymtrace_process_", "pymtrace_scrape_")), name


def test_promtool_check_metrics_on_a_scrape(served):
    promtool = need_tool("promtool")
    src = FakeSource(
        {
            "processes": {
                str(p): proc_entry(p, f"c{p % 7}", malloc=p, requested=p * 8, live=p, sizes=[0, 1, 2, 3], faults=(p, 1))
                for p in range(1, 50)
            },
            "slab": {"dentry": {"allocs": 1, "frees": 0, "bytes_alloc": 192, "bytes_req": 192}},
            "glibc": {
                "1": {
                    "arenas": 1,
                    "heaps": 0,
                    "heap_bytes": 0,
                    "sbrk_bytes": 4096,
                    "mmap_threshold": 131072,
                    "trim_threshold": 131072,
                    "arena_lock_waits": 0,
                    "retries": {"malloc": 0},
                }
            },
            "lost": {"ringbuf": 0},
        }
    )
    ex = served([src])
    status, _, body = http_get(ex.url + "/metrics")
    assert status == 200
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


# ---------------------------------------------------------------- HTTP


def test_index_links_to_metrics_and_unknown_paths_404(served):
    ex = served([FakeSource()])
    status, headers, body = http_get(ex.url + "/")
    assert status == 200 and "text/html" in headers["Content-Type"]
    assert b'href="/metrics"' in body
    assert http_get(ex.url + "/nope")[0] == 404
    req = urllib.request.Request(ex.url + "/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405


def test_gzip_and_openmetrics_negotiation(served):
    src = FakeSource({"processes": {str(p): proc_entry(p, f"c{p}", malloc=p) for p in range(1, 40)}})
    ex = served([src])
    status, headers, body = http_get(ex.url + "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers.get("Content-Encoding") == "gzip"
    import gzip

    assert b"pymtrace_malloc_calls_total" in gzip.decompress(body)
    status, headers, body = http_get(ex.url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert "openmetrics" in headers["Content-Type"] and body.rstrip().endswith(b"# EOF")


def _raw(port, payload, read=True):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(payload)
    data = b""
    if read:
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
    s.close()
    return data


def test_bad_requests_and_stalled_clients_do_not_block_scrapes(served):
    src = FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})
    ex = served([src], timeout=3.0)
    # clients that connect and send nothing, or half a request line, and keep the socket
    stalled = []
    for i in range(10):
        s = socket.create_connection(("127.0.0.1", ex.port), timeout=30)
        if i % 2:
            s.sendall(b"GET /metr")
        stalled.append(s)
    try:
        for payload in (
            b"GARBAGE\r\n\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
            b"\x16\x03\x01\x00\xff" + b"\0" * 64,
            b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"b" * 70000 + b"\r\n\r\n",
        ):
            reply = _raw(ex.port, payload)
            assert reply == b"" or reply.startswith(b"HTTP/1."), reply[:80]
            if reply:
                assert int(reply.split()[1]) in (400, 414, 431, 505), reply[:80]
        t0 = time.monotonic()
        for _ in range(5):
            status, _, body = http_get(ex.url + "/metrics", timeout=5)
            assert status == 200 and b'pymtrace_malloc_calls_total{call="malloc",comm="app"} 1.0' in body
        assert time.monotonic() - t0 < 4, "scrapes waited for stalled clients"
        # the stalled connections are closed by the server after the timeout
        time.sleep(3.5)
        stalled[0].settimeout(2)
        assert stalled[0].recv(10) == b""
    finally:
        for s in stalled:
            s.close()


def test_connection_cap_keeps_memory_bounded_but_scrapes_resume(served):
    ex = served([FakeSource()], timeout=1.0, max_connections=4)
    held = [socket.create_connection(("127.0.0.1", ex.port)) for _ in range(8)]
    try:
        time.sleep(0.3)
        # beyond the cap, the oldest connections still waiting for their request are closed
        assert ex.server.evicted >= 4
        assert ex.server.open_connections() <= 4
        held[0].settimeout(2)
        assert held[0].recv(10) == b""
        assert http_get(ex.url + "/metrics", timeout=2)[0] == 200  # while the newest ones are held
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)
    assert http_get(ex.url + "/metrics")[0] == 200
    deadline = time.monotonic() + 5  # the last connection's thread ends just after its reply
    while ex.server.open_connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ex.server.open_connections() == 0


class SlowClients:
    """Slowloris: clients that each send one more byte of a request every PERIOD seconds
    (well within the server's per-read timeout) and reconnect whenever the server closes
    them, from the given source addresses; one thread, bounded in count and time."""

    def __init__(self, port, sources, period=0.5, duration=10.0):
        self.port, self.sources, self.period, self.duration = port, sources, period, duration
        self.connects = self.closed_by_server = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import select

        payload = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 2000
        socks = {}  # index -> [socket, bytes sent]
        end = time.monotonic() + self.duration
        while not self.stop.is_set() and time.monotonic() < end:
            for i, src in enumerate(self.sources):
                entry = socks.get(i)
                if entry is not None:
                    if select.select([entry[0]], [], [], 0)[0]:  # EOF or a reply: closed by the server
                        entry[0].close()
                        self.closed_by_server += 1
                        del socks[i]
                        entry = None
                if entry is None:
                    try:
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=1, source_address=(src, 0))
                    except OSError:
                        continue
                    self.connects += 1
                    entry = socks[i] = [s, 0]
                try:
                    entry[0].send(payload[entry[1] : entry[1] + 1])
                    entry[1] += 1
                except OSError:
                    entry[0].close()
                    del socks[i]
            self.stop.wait(self.period)
        for s, _ in socks.values():
            s.close()

    def close(self):
        self.stop.set()
        self.thread.join(10)


def _timed_get(url, headers=None, source=None):
    """(status or the exception's name, seconds) of one GET, from SOURCE address if given."""
    import http.client

    u = urllib.parse.urlsplit(url)
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=5, source_address=(source, 0) if source else None)
        c.request("GET", u.path or "/", headers=headers or {})
        r = c.getresponse()
        r.read()
        c.close()
        return r.status, time.monotonic() - t0
    except OSError as exc:
        return type(exc).__name__, time.monotonic() - t0


def test_slowloris_clients_do_not_block_a_concurrent_scrape(served):
    """70 clients trickling their requests a byte at a time (from 5 addresses, 14 each:
    more than the 64 connection slots, under the per-address cap) never time out byte by
    byte; they used to hold every slot so that every scrape was refused. A request must
    now arrive whole within the request timeout, and a new connection evicts the oldest
    one still waiting for its request: every scrape is served within a bound."""
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], timeout=3.0, request_timeout=2.0)
    assert _timed_get(ex.url + "/metrics")[0] == 200  # the scraper, before the attack
    sources = [f"127.0.0.{2 + i // 14}" for i in range(70)]
    slow = SlowClients(ex.port, sources, period=0.5, duration=12)
    try:
        deadline = time.monotonic() + 5
        while slow.connects < 70 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # all slots taken by now (before the fix: for good)
        results = []
        for _ in range(6):
            results.append(_timed_get(ex.url + "/metrics"))
            time.sleep(0.5)
        assert all(status == 200 for status, _ in results), results
        assert max(t for _, t in results) < 3.0, results
        # the slow clients were cut off (deadline or eviction), not just outnumbered
        assert slow.closed_by_server >= 6, (slow.connects, slow.closed_by_server)
        assert ex.server.open_connections() <= 64
    finally:
        slow.close()


def test_a_request_must_arrive_whole_within_the_request_timeout(served):
    """A client trickling a byte every 0.5 s never trips the 3 s per-read timeout; the
    connection is closed once its request has not arrived whole within the 1.5 s deadline."""
    ex = served([FakeSource()], timeout=3.0, request_timeout=1.5)
    s = socket.create_connection(("127.0.0.1", ex.port), timeout=10)
    try:
        t0 = time.monotonic()
        closed = None
        for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 20:
            try:
                s.send(bytes([b]))
            except OSError:
                closed = time.monotonic() - t0
                break
            s.settimeout(0.5)
            try:
                if s.recv(100) == b"":
                    closed = time.monotonic() - t0
                    break
            except socket.timeout:
                pass
            if time.monotonic() - t0 > 8:
                break
        assert closed is not None and 1.3 < closed < 6.0, closed
    finally:
        s.close()


def _auth_config(tmp_path, cost=8):
    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(cost)).decode()
    cfg = tmp_path / "auth.yml"
    cfg.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    return webconfig.load(cfg)


@pytest.fixture
def bcrypt_calls(monkeypatch):
    """Counts bcrypt.checkpw calls (what a password check costs: ~70 ms at cost 10)."""
    import bcrypt

    calls = []
    real = bcrypt.checkpw

    def counting(password, hashed):
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    return calls


def test_repeated_valid_credentials_cost_one_bcrypt_check(served, tmp_path, bcrypt_calls):
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=_auth_config(tmp_path))
    # a burst of concurrent requests with the same credentials, then sequential ones
    barrier = threading.Barrier(12)
    results = []

    def get():
        barrier.wait()
        results.append(http_get(ex.url + "/metrics", _basic("prom", "s3cret"))[0])

    threads = [threading.Thread(target=get) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    results += [http_get(ex.url + "/metrics", _basic("prom", "s3cret"))[0] for _ in range(10)]
    assert results == [200] * 22
    assert len(bcrypt_calls) == 1
    # a wrong password is refused, and refused again without another bcrypt check
    assert http_get(ex.url + "/metrics", _basic("prom", "s3cre"))[0] == 401
    assert http_get(ex.url + "/metrics", _basic("prom", "s3cre"))[0] == 401
    assert len(bcrypt_calls) == 2
    assert http_get(ex.url + "/metrics", _basic("prom", "s3cret"))[0] == 200
    assert len(bcrypt_calls) == 2


def test_wrong_password_flood_costs_bounded_bcrypt_and_a_valid_scrape_is_served(served, tmp_path, bcrypt_calls):
    """4 clients send wrong passwords as fast as they can for 3 s (one repeated wrong
    password, and a new one each time), from another address than the scraper's. Each used
    to cost a bcrypt check; now repeats cost none and each address gets a few checks a
    second (then 429). Scrapes with the valid password go on being served meanwhile."""
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=_auth_config(tmp_path))
    statuses = {}
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def flood(k):
        for i in range(400):
            if time.monotonic() > stop:
                break
            pw = "wrong" if i % 2 else f"wrong-{k}-{i}"
            status, _ = _timed_get(ex.url + "/metrics", _basic("prom", pw), source="127.0.0.2")
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    scrapes = []
    while time.monotonic() < stop:
        scrapes.append(_timed_get(ex.url + "/metrics", _basic("prom", "s3cret")))
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    # 1 for the scraper, a burst of 5 and about 1/s for the flooding address
    assert len(bcrypt_calls) <= 1 + 5 + 4 + 1, (len(bcrypt_calls), statuses)
    assert sum(statuses.values()) >= 100, statuses  # it was a flood
    assert set(statuses) <= {401, 429}, statuses
    assert scrapes and all(status == 200 for status, _ in scrapes), scrapes
    assert max(t for _, t in scrapes) < 3.0, scrapes


class SlowSource(FakeSource):
    """A source whose snapshot takes as long as reading real BPF maps (~0.1 s)."""

    def snapshot(self):
        time.sleep(0.1)
        return super().snapshot()


def test_a_flood_of_valid_requests_does_not_starve_another_scraper(served):
    """48 clients from one address request /metrics as fast as they can for 3 s (field
    report: 1,000/s let few scrapes through). Each request used to read the maps on its own,
    one after the other, so a scrape queued behind all of them; now concurrent requests
    share one reading, and one address holds at most 16 connections."""
    src = SlowSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})
    ex = served([src])
    served_flood = [0]
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def flood():
        for _ in range(300):
            if time.monotonic() > stop:
                break
            if _timed_get(ex.url + "/metrics", source="127.0.0.2")[0] == 200:
                with lock:
                    served_flood[0] += 1

    threads = [threading.Thread(target=flood) for _ in range(48)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    scrapes = []
    while time.monotonic() < stop:
        scrapes.append(_timed_get(ex.url + "/metrics"))
        time.sleep(0.2)
    for t in threads:
        t.join(30)
    assert scrapes and all(status == 200 for status, _ in scrapes), scrapes
    assert max(t for _, t in scrapes) < 2.5, scrapes  # ~5 s before
    assert served_flood[0] > src.calls, (served_flood[0], src.calls)  # readings were shared


def test_listen_parsing():
    assert exporter.parse_listen(":19733") == ("", 19733)
    assert exporter.parse_listen("127.0.0.1:80") == ("127.0.0.1", 80)
    assert exporter.parse_listen("[::1]:9") == ("::1", 9)
    assert exporter.parse_listen("8080") == ("", 8080)
    with pytest.raises(PymtraceError):
        exporter.parse_listen("host")


# ---------------------------------------------------------------- TLS + basic auth


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(6)).decode().replace("$2b$", "$2y$")
    (d / "web.yml").write_text(
        "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n"
        f"basic_auth_users:\n  prom: '{hashed}'\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    )
    return d


def _basic(user, pw):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}


def test_tls_and_basic_auth(served, tls_files):
    web = webconfig.load(tls_files / "web.yml")
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=4)}})], web=web)
    ctx = ssl.create_default_context(cafile=str(tls_files / "cert.pem"))
    assert http_get(ex.url + "/metrics", context=ctx)[0] == 401
    assert http_get(ex.url + "/metrics", _basic("prom", "wrong"), context=ctx)[0] == 401
    assert http_get(ex.url + "/metrics", _basic("nobody", "s3cret"), context=ctx)[0] == 401
    assert http_get(ex.url + "/", context=ctx)[0] == 401
    status, headers, body = http_get(ex.url + "/metrics", _basic("prom", "s3cret"), context=ctx)
    assert status == 200 and b'call="malloc"' in body
    assert headers.get("X-Frame-Options") == "deny"
    # plain HTTP to the TLS port gets nothing useful, and a client stuck in the handshake
    # does not hold up others
    stuck = socket.create_connection(("127.0.0.1", ex.port))
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=5).read()
        assert http_get(ex.url + "/metrics", _basic("prom", "s3cret"), context=ctx, timeout=5)[0] == 200
    finally:
        stuck.close()


def test_client_certificates_required_and_verified(served, tls_files, tmp_path):
    cfg = tmp_path / "mtls.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {tls_files}/cert.pem\n"
        "  min_version: TLS12\n"
    )
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=webconfig.load(cfg))
    ctx = ssl.create_default_context(cafile=str(tls_files / "cert.pem"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(ex.url + "/metrics", timeout=5, context=ctx).read()
    ctx.load_cert_chain(str(tls_files / "cert.pem"), str(tls_files / "key.pem"))
    assert http_get(ex.url + "/metrics", context=ctx)[0] == 200


def test_label_by_cgroup():
    groups = {1: "/system.slice/nginx.service", 2: "/system.slice/nginx.service", 3: "/user.slice"}
    agg = exporter.Aggregator(label_by="cgroup", alive=lambda pid: True, cgroup_of=groups.get)
    agg.update({p: proc_entry(p, "x", malloc=p) for p in groups}, now=0)
    s = agg.series()
    assert s["/system.slice/nginx.service"]["counters"][("calls", "malloc")] == 3
    assert s["/user.slice"]["counters"][("calls", "malloc")] == 3
    import os

    assert (exporter._cgroup_of(os.getpid()) or "/").startswith("/")


def test_web_config_errors(tmp_path, tls_files):
    cases = {
        "tls_server_config:\n  cert_file: x\n": "cert_file and key_file",
        "tls_server_config:\n  cert_flie: x\n": "unknown key",
        "basic_auth_users:\n  u: plaintext\n": "bcrypt",
        "bogus: 1\n": "unknown key",
        f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
        "  min_version: TLS99\n": "min_version",
        ": : :\n": "YAML",
    }
    for text, needle in {**cases, **BAD_WEB_CONFIGS(tls_files)}.items():
        f = tmp_path / "w.yml"
        f.write_text(text)
        with pytest.raises(webconfig.WebConfigError, match=needle):
            webconfig.load(f)
    with pytest.raises(webconfig.WebConfigError, match="cannot read"):
        webconfig.load(tmp_path / "missing.yml")
    (tmp_path / "bin.yml").write_bytes(b"\xff\xfe\x00\x01 binary")
    with pytest.raises(webconfig.WebConfigError, match="web config"):
        webconfig.load(tmp_path / "bin.yml")


def BAD_WEB_CONFIGS(tls_files):
    """Web configs that cannot work or have the wrong types -> the one-line error expected."""
    tls = f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
    return {
        # no TLS version is both >= min and <= max: refused instead of failing every handshake
        tls + "  min_version: TLS13\n  max_version: TLS12\n": "min_version TLS13 is above max_version TLS12",
        tls + "  max_version: TLS11\n": "min_version TLS12 is above max_version TLS11",  # default min TLS12
        # a header value with CR/LF would inject headers into every response
        'http_server_config:\n  headers:\n    X-Frame-Options: "deny\\r\\nSet-Cookie: a=b"\n': "line break",
        'http_server_config:\n  headers:\n    X-Frame-Options: "deny\\nX: y"\n': "line break",
        "http_server_config:\n  headers:\n    'X Bad': deny\n": "not a valid header name",
        # wrong types: one line each, never a traceback
        "tls_server_config:\n  cert_file: [a, b]\n  key_file: k\n": "cert_file must be a string, not a list",
        tls + "  client_auth_type: [RequireAndVerifyClientCert]\n": "client_auth_type must be a string",
        tls + "  min_version: [TLS12]\n": "min_version must be a string",
        tls + "  max_version: {a: 1}\n": "max_version must be a string, not a mapping",
        tls + "  client_ca_file: 7\n": "client_ca_file must be a string, not a number",
        tls + "  cipher_suites: [1, 2]\n": "cipher_suites must be a list of strings",
        tls + "  prefer_server_cipher_suites: maybe\n": "true or false",
        "http_server_config:\n  headers:\n    X-Frame-Options: [deny, sameorigin]\n": "X-Frame-Options must be a string",
        "http_server_config:\n  headers: [a]\n": "headers must be a mapping, not a list",
        "http_server_config: [1]\n": "http_server_config must be a mapping",
        "http_server_config:\n  http2: [true]\n": "http2 must be true or false",
        "basic_auth_users:\n  prom: [a, b]\n": "bcrypt hash",
        "basic_auth_users: [prom]\n": "basic_auth_users must be a mapping",
        "- a\n- b\n": "the file must be a mapping",
    }


def test_bad_web_configs_are_one_line_errors_from_the_cli(tmp_path, tls_files):
    from conftest import run_pymtrace

    for i, text in enumerate(BAD_WEB_CONFIGS(tls_files)):
        f = tmp_path / f"bad{i}.yml"
        f.write_text(text)
        r = run_pymtrace("exporter", "--listen", "127.0.0.1:0", "--web-config", str(f), timeout=30)
        assert r.returncode == 2, (text, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pymtrace: error: web config"), (text, r.stderr)


def test_real_prometheus_scrapes_over_tls_with_basic_auth(served, tls_files, tmp_path):
    web = webconfig.load(tls_files / "web.yml")
    src = FakeSource({"processes": {"1": proc_entry(1, "app", malloc=42, requested=4200, live=100)}})
    ex = served([src], web=web)
    prom = Prometheus(
        tmp_path,
        [
            {
                "job_name": "pymtrace",
                "scheme": "https",
                "tls_config": {"ca_file": str(tls_files / "cert.pem")},
                "basic_auth": {"username": "prom", "password": "s3cret"},
                "static_configs": [{"targets": [f"127.0.0.1:{ex.port}"]}],
            }
        ],
    )
    try:
        got = prom.wait_for(lambda: prom.query('pymtrace_malloc_calls_total{call="malloc"}'), what="a TLS scrape")
        assert list(got.values()) == [42.0]
        assert {dict(k)["comm"] for k in got} == {"app"}
        src.snap["processes"]["1"] = proc_entry(1, "app", malloc=50, requested=5000, live=100)
        prom.wait_for(
            lambda: list(prom.query('pymtrace_malloc_calls_total{call="malloc"}').values()) == [50.0],
            what="the new value",
        )
    finally:
        prom.stop()


# ---------------------------------------------------------------- deploy files


def test_promtool_checks_config_and_rules():
    promtool = need_tool("promtool")
    rules = EXPORTERS / "alerts.rules.yml"
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    r = subprocess.run(
        [promtool, "check", "config", str(EXPORTERS / "prometheus.yml")], capture_output=True, text=True, cwd=EXPORTERS
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [promtool, "test", "rules", str(EXPORTERS / "alerts.test.yml")], capture_output=True, text=True, cwd=EXPORTERS
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _exposed_names():
    """Every metric name the exporter can expose (one scrape with every kind of data)."""
    from prometheus_client import CollectorRegistry, generate_latest

    src = FakeSource(
        {
            "processes": {"7": proc_entry(7, "app", malloc=3, requested=10, live=5, sizes=[1, 1], faults=(1, 1))},
            "slab": {"k": {"allocs": 1, "frees": 1, "bytes_alloc": 8, "bytes_req": 8}},
            "glibc": {
                "7": {
                    "arenas": 1,
                    "heaps": 1,
                    "heap_bytes": 1,
                    "sbrk_bytes": 1,
                    "mmap_threshold": 1,
                    "trim_threshold": 1,
                    "arena_lock_waits": 1,
                    "retries": {"malloc": 1},
                    "sbrk_trimmed_bytes": 1,
                }
            },
            "lost": {"x": 0},
        }
    )

    class Stats:
        def read(self):
            return {"progs": {"p": (1, 1)}, "maps": {"m": (1, 2, "hash")}}

        def enabled(self):
            return True

    reg = CollectorRegistry(auto_describe=False)
    reg.register(exporter.ExporterCollector([src], exporter.Aggregator(alive=lambda p: True), Stats()))
    return metric_names(generate_latest(reg).decode())


PROMQL_WORDS = {
    "sum",
    "rate",
    "irate",
    "increase",
    "by",
    "without",
    "topk",
    "bottomk",
    "histogram_quantile",
    "deriv",
    "avg",
    "max",
    "min",
    "count",
    "on",
    "ignoring",
    "group_left",
    "le",
    "and",
    "or",
    "unless",
    "offset",
    "delta",
    "label_replace",
    "clamp_min",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "predict_linear",
    "abs",
    "vector",
    "scalar",
    "time",
    "bool",
    "absent",
}


def _promql_metric_names(expr):
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n.startswith("pymtrace_")}


def test_dashboard_is_valid_json_and_uses_only_exposed_metrics():
    dash = json.loads((EXPORTERS / "grafana-dashboard.json").read_text())
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            if isinstance(node.get("query"), str) and "pymtrace_" in node["query"]:
                exprs.append(node["query"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    assert len(exprs) >= 8
    used = set().union(*(_promql_metric_names(e) for e in exprs))
    exposed = _exposed_names()
    assert used, exprs
    assert used <= exposed, f"dashboard uses metrics the exporter does not expose: {sorted(used - exposed)}"
    # the rules too
    import yaml

    rules = yaml.safe_load((EXPORTERS / "alerts.rules.yml").read_text())
    rule_used = set().union(*(_promql_metric_names(r["expr"]) for g in rules["groups"] for r in g["rules"]))
    assert rule_used and rule_used <= exposed, sorted(rule_used - exposed)


def test_systemd_unit_and_daemonset(tmp_path):
    unit = (EXPORTERS / "pymtrace-exporter.service").read_text()
    assert re.search(r"^ExecStart=/usr/local/bin/pymtrace exporter", unit, re.M)
    if shutil.which("systemd-analyze"):
        r = subprocess.run(
            ["systemd-analyze", "verify", str(EXPORTERS / "pymtrace-exporter.service")], capture_output=True, text=True
        )
        problems = [
            line
            for line in r.stderr.splitlines()
            if "pymtrace-exporter.service" in line
            and not re.search(r"not executable|No such file|Failed to prepare filename", line)
        ]
        assert not problems, r.stderr
    import yaml

    docs = [d for d in yaml.safe_load_all((EXPORTERS / "kubernetes-daemonset.yaml").read_text()) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # comm/PIDs of the host's processes, /proc/PID/maps of each libc
    c = pod["containers"][0]
    assert c["securityContext"].get("privileged") is not True  # capabilities, not privileged
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"BPF", "PERFMON", "SYS_RESOURCE"} <= caps
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/lib/modules", "/usr/src"} <= mounts
    assert any(p.get("containerPort") == exporter.DEFAULT_PORT for p in c["ports"])
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_cli_help_and_argument_errors():
    from conftest import run_pymtrace

    r = run_pymtrace("exporter", "--help")
    assert r.returncode == 0 and "--web-config" in r.stdout and str(exporter.DEFAULT_PORT) in r.stdout
    # per-call uprobes are an explicit opt-in whose cost --help states
    assert "--per-call" in r.stdout and "2 us per malloc+free pair" in " ".join(r.stdout.split())
    r = run_pymtrace("exporter", "--per-call", "--always-on")
    assert r.returncode != 0 and "contradict" in r.stderr and "Traceback" not in r.stderr
    r = run_pymtrace("exporter", "--comm", "(")
    assert r.returncode != 0 and "--comm" in r.stderr
    r = run_pymtrace("exporter", "--listen", "nonsense")
    assert r.returncode != 0
