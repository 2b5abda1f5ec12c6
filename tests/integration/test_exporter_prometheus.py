"""A real Prometheus server scrapes the exporter (a fake source, served in this process) over
TLS with basic auth, and sees a counter's new value."""

from support.exporter import FakeSource, proc_entry
from support.prometheus import Prometheus

from pymtrace.sinks import webconfig


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
