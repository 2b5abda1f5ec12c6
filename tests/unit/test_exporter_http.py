"""The exporter's HTTP server (pymtrace.sinks.http) with real sockets on 127.0.0.1: the index
page and 404/405, gzip and OpenMetrics negotiation, bad requests and stalled clients,
the connection caps, slowloris clients, the per-request deadline, a flood of valid
requests (single-flight rendering), --listen parsing."""

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from support.exporter import FakeSource, proc_entry, timed_get
from support.prometheus import http_get
from support.slowloris import SlowClients

from pymtrace.errors import PymtraceError
from pymtrace.sinks.http import parse_listen


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


SLOW_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 2000


def test_slowloris_clients_do_not_block_a_concurrent_scrape(served):
    """70 clients trickling their requests a byte at a time (from 5 addresses, 14 each:
    more than the 64 connection slots, under the per-address cap) never time out byte by
    byte, yet they do not hold the slots: a request must arrive whole within the request
    timeout, and a new connection evicts the oldest one still waiting for its request, so
    every scrape is served within a bound."""
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], timeout=3.0, request_timeout=2.0)
    assert timed_get(ex.url + "/metrics")[0] == 200  # the scraper, before the attack
    sources = [f"127.0.0.{2 + i // 14}" for i in range(70)]
    slow = SlowClients(ex.port, sources, SLOW_REQUEST, period=0.5, duration=12)
    try:
        deadline = time.monotonic() + 5
        while slow.connects < 70 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # all slots taken by now: only the deadline and eviction free them
        results = []
        for _ in range(6):
            results.append(timed_get(ex.url + "/metrics"))
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


class SlowSource(FakeSource):
    """A source whose snapshot takes as long as reading real BPF maps (~0.1 s)."""

    def snapshot(self):
        time.sleep(0.1)
        return super().snapshot()


def test_a_flood_of_valid_requests_does_not_starve_another_scraper(served):
    """48 clients from one address request /metrics as fast as they can for 3 s (about
    1,000/s) while another scraper asks too: concurrent requests share one reading of the
    maps instead of queueing one reading each, and one address holds at most 16
    connections, so the other scraper is served."""
    src = SlowSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})
    ex = served([src])
    served_flood = [0]
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def flood():
        for _ in range(300):
            if time.monotonic() > stop:
                break
            if timed_get(ex.url + "/metrics", source="127.0.0.2")[0] == 200:
                with lock:
                    served_flood[0] += 1

    threads = [threading.Thread(target=flood) for _ in range(48)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    scrapes = []
    while time.monotonic() < stop:
        scrapes.append(timed_get(ex.url + "/metrics"))
        time.sleep(0.2)
    for t in threads:
        t.join(30)
    assert scrapes and all(status == 200 for status, _ in scrapes), scrapes
    assert max(t for _, t in scrapes) < 2.5, scrapes  # ~5 s before
    assert served_flood[0] > src.calls, (served_flood[0], src.calls)  # readings were shared


def test_listen_parsing():
    assert parse_listen(":19733") == ("", 19733)
    assert parse_listen("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_listen("[::1]:9") == ("::1", 9)
    assert parse_listen("8080") == ("", 8080)
    with pytest.raises(PymtraceError):
        parse_listen("host")
