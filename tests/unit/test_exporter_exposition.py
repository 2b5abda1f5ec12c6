"""The exporter's exposition (pymtrace.sinks.prometheus): metric names, types and the size
histogram; promtool on a scrape; every metric the Grafana dashboard and the alert rules use
is one the exporter exposes. A real Prometheus scrapes it in tests/integration/test_exporter_prometheus.py.

The BPF end-to-end tests (real BPF sources, C workload, churn) are in tests/live/test_exporter_bpf.py.
"""

import json
import re
import subprocess

from support.exporter import EXPORTERS, FakeSource, proc_entry
from support.prometheus import http_get, metric_names, need_tool, parse_metrics, sample

from pymtrace.sinks import prometheus


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
    reg.register(prometheus.ExporterMetrics([src], prometheus.Aggregator(alive=lambda p: True)))
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
    reg.register(prometheus.ExporterMetrics([src], prometheus.Aggregator(alive=lambda p: True), Stats()))
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
