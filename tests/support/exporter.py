"""In-process exporter harness shared by the exporter tests (no tests here): fake
sources, an exporter HTTP(S) server in a thread, TLS files, HTTP helpers. The fixtures that
use them (`served`, `tls_files`) are in tests/conftest.py."""

import base64
import http.client
import json
import pathlib
import subprocess
import threading
import time
import urllib.parse

from pymtrace.sinks import prometheus
from pymtrace.sinks.http import INDEX, make_server

EXPORTERS = pathlib.Path(__file__).resolve().parents[2] / "exporters"  # the deploy files


class FakeSource:
    """Stands in for a BPF source: snapshot() returns whatever the test put in .snap."""

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
        self.agg = aggregator or prometheus.Aggregator(label_by=label_by, alive=lambda pid: True)
        self.metrics = prometheus.ExporterMetrics(sources, self.agg, None, label_by=label_by)
        self.registry.register(self.metrics)
        self.server = make_server(
            ("127.0.0.1", 0),
            self.registry,
            web=web,
            timeout=timeout,
            index_html=INDEX.format(mode="full", label=label_by, version="t"),
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


def make_tls_files(d):
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem) and a web config (web.yml)
    asking for it and for basic auth as prom:s3cret, in directory D (needs openssl)."""
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


def basic_auth(user, pw):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}


def timed_get(url, headers=None, source=None):
    """(status or the exception's name, seconds) of one GET, from SOURCE address if given."""
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
