"""Prometheus-side helpers shared by the exporter tests (no tests here): a free port, HTTP
GET, exposition parsing, a real Prometheus server scraping an exporter, tool lookup."""

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from support.needs import missing_or_fail


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_tool(name):
    path = shutil.which(name)
    if path is None:
        missing_or_fail(f"{name} is not installed (Debian package prometheus)")
    return path


def http_get(url, headers=None, timeout=10, context=None):
    """(status, headers, body-bytes) for a GET, without raising on HTTP errors."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_metrics(text):
    """{(name, frozenset(labels.items())): value} of a text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(metrics, name, **labels):
    return metrics.get((name, frozenset(labels.items())))


def metric_names(text):
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


class Prometheus:
    """A real Prometheus server on 127.0.0.1 with a temporary config and data directory."""

    def __init__(self, tmp_path, scrape_configs, interval="1s"):
        self.binary = need_tool("prometheus")
        self.port = free_port()
        self.dir = tmp_path / f"prometheus-{self.port}"
        self.dir.mkdir()
        cfg = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": scrape_configs,
        }
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(json.dumps(cfg))  # JSON is YAML
        self.log = open(self.dir / "log", "w+")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.logtext()}")
            try:
                if http_get(self.url + "/-/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not become ready: {self.logtext()}")

    def logtext(self):
        self.log.flush()
        return (self.dir / "log").read_text()[-3000:]

    def api(self, path, **params):
        status, _, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        doc = json.loads(body)
        assert doc.get("status") == "success", doc
        return doc["data"]

    def query(self, expr):
        """{frozenset(labels without __name__): float} of an instant query."""
        data = self.api("query", query=expr)
        return {
            frozenset((k, v) for k, v in r["metric"].items() if k != "__name__"): float(r["value"][1])
            for r in data["result"]
        }

    def targets(self):
        return self.api("targets")["activeTargets"]

    def wait_for(self, predicate, timeout=40, what="condition"):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; targets: {self.targets()}; log: {self.logtext()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
