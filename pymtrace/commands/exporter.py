"""`pymtrace exporter`: serve the live malloc/slab/fault/glibc metrics to Prometheus.

The exporter runs the same collectors as `pymtrace top` (pymtrace.sources.bundle.Sources); pymtrace.sinks.prometheus reads their BPF maps at scrape time and
turns them into monotonic per-label series, pymtrace.sinks.http serves them. This module
holds the arguments, the help text and the orchestration.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from typing import TYPE_CHECKING

from pymtrace import __version__
from pymtrace.commands import DEFAULT_WINDOW, add_budget_arguments
from pymtrace.errors import PymtraceError
from pymtrace.sinks.http import INDEX, make_server
from pymtrace.sinks.prometheus import Aggregator, ExporterMetrics
from pymtrace.tracee import proc

if TYPE_CHECKING:
    from pymtrace.sources.bundle import Sources

DEFAULT_PORT = 19733
HELP = """Serve live allocation metrics to Prometheus (/metrics), from the same BPF
collectors as `pymtrace top`. Per-process series are labelled by comm (default),
cgroup, or PID; at most --max-series label values (default 500, 20 by PID) plus "other"."""
DEFAULT_BUDGET = 1.0  # percent: the default mode's overhead budget (--max-overhead)
EPILOG = f"""examples:
  sudo pymtrace exporter                              # all processes, :{DEFAULT_PORT}: estimated malloc rates under 1 %
  sudo pymtrace exporter --always-on                  # nothing on the malloc path: tracepoints + USDT + faults
  sudo pymtrace exporter --per-call -p 1234           # exact per-call malloc counts (costly, see OVERHEAD)
  sudo pymtrace exporter --comm '^(nginx|postgres)$' --listen 127.0.0.1:{DEFAULT_PORT}
  sudo pymtrace exporter --per-call --label-by pid --max-series 20 -p 1234 -p 5678
  sudo pymtrace exporter --web-config /etc/pymtrace/web.yml   # TLS and basic auth

The default port {DEFAULT_PORT} lies outside the 9100-9999 range of Prometheus's default
port allocation list (that range is fully allocated). See docs/exporter.md for the metrics
and the deploy files in exporters/.

OVERHEAD: page-fault and slab tracepoints and glibc's USDT probes on its slow paths cost
~0.1-0.3 us per page fault and nothing measurable per malloc. By default `pymtrace top`'s
uprobes on malloc, calloc, realloc, free and the memalign family are attached in windows
(--window seconds, at random times) under an overhead budget: what they cost the traced
processes -- the traps (calibrated at start), the BPF run time (the kernel's statistics),
the attach/detach CPU -- is measured and kept under {DEFAULT_BUDGET:g} % of those processes' CPU
time (--max-overhead PCT changes it); the pymtrace_malloc_*_estimated series are estimates
(pymtrace_malloc_estimate_error_ratio: their 95 % error), pymtrace_exporter_duty_cycle and
pymtrace_exporter_overhead_ratio say what it cost. --always-on puts nothing on the malloc
path. --per-call keeps the uprobes attached: every call counted (exact, live bytes too), at
~2 us per malloc+free pair instead of ~15 ns (~145x, measured on a busy 2-core machine,
bench/exporter_bench.py; an allocation-heavy Python program ran 8-13x slower) in EVERY glibc
process on the host unless -p narrows it. A scrape reads the BPF maps: ~50 ms and ~5 % of a
core at one scrape a second for ~1,000 series, ~0.5 s for ~14,000. Start-up compiles the BPF
programs (seconds; longer on a loaded machine). See docs/exporter.md."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        default=f":{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"address to serve on (default :{DEFAULT_PORT}, all interfaces)",
    )
    parser.add_argument(
        "-p",
        "--pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="only these processes (repeatable; default: all)",
    )
    parser.add_argument("--comm", metavar="REGEX", help="only processes whose comm matches REGEX")
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="count every malloc-API call exactly (pymtrace_malloc_* series) with uprobes on "
        "malloc/free/... kept attached: ~2 us per malloc+free pair in every traced process (~145x "
        "a bare pair), all glibc processes of the host unless -p narrows it",
    )
    parser.add_argument(
        "--always-on",
        action="store_true",
        help="nothing on the malloc path: tracepoints, USDT probes and faults only (no malloc series)",
    )
    add_budget_arguments(
        parser,
        f"the malloc uprobes' measured cost kept under PCT %% of the traced processes' CPU time "
        f"(default {DEFAULT_BUDGET:g}: estimated pymtrace_malloc_*_estimated series)",
        "how long each window keeps the malloc uprobes attached",
    )
    parser.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS and basic-auth settings (Prometheus exporter-toolkit web config format)",
    )
    parser.add_argument(
        "--label-by",
        choices=("comm", "cgroup", "pid"),
        default="comm",
        help="what per-process series are keyed by (default comm)",
    )
    parser.add_argument(
        "--max-series",
        type=int,
        default=None,
        metavar="N",
        help="at most N label values besides \"other\" (default 20 with --label-by pid, else 500)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="drop the series of processes gone longer than this (default 300)",
    )
    parser.add_argument(
        "--max-processes",
        type=int,
        default=None,
        metavar="N",
        help="capacity of the collectors' per-process BPF maps (LRU; default the collectors')",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="per-connection socket timeout (default 10)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a request (TLS handshake, request line, headers) must arrive whole within "
        "this time of the connection or of the previous response (default 5)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=64,
        metavar="N",
        help="concurrent connections (default 64); beyond it the oldest connection still "
        "waiting for its request or authentication is closed",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=16,
        metavar="N",
        help="concurrent connections per client address (default 16)",
    )
    parser.add_argument(
        "--no-bpf-stats", action="store_true", help="do not turn on the kernel's BPF run-time statistics"
    )


def _check_args(args: argparse.Namespace) -> None:
    if args.comm:
        try:
            re.compile(args.comm)
        except re.error as exc:
            raise PymtraceError(f"--comm {args.comm!r} is not a valid regular expression: {exc}") from None
    if args.max_series is None:
        args.max_series = 20 if args.label_by == "pid" else 500
    if args.max_series < 1:
        raise PymtraceError("--max-series must be at least 1")
    if args.grace < 0:
        raise PymtraceError("--grace must be >= 0")
    if args.per_call and args.always_on:
        raise PymtraceError("--per-call and --always-on contradict each other")
    if args.max_overhead is not None and (args.per_call or args.always_on):
        raise PymtraceError("--max-overhead budgets the malloc uprobes: not with --per-call or --always-on")
    if args.window != DEFAULT_WINDOW and (args.per_call or args.always_on):
        raise PymtraceError("--window sets the budget's windows: not with --per-call or --always-on")
    if mode(args) == "budget":
        from pymtrace.sources.budget import Budget

        Budget(_budget_pct(args), args.window).check()
        if args.no_bpf_stats:
            raise PymtraceError(
                "--no-bpf-stats: the overhead budget measures the BPF run time with them (use --always-on or --per-call)"
            )
    if not (args.timeout > 0 and args.request_timeout > 0):
        raise PymtraceError("--timeout and --request-timeout must be > 0")
    if args.max_connections < 1 or args.max_connections_per_client < 1:
        raise PymtraceError("--max-connections and --max-connections-per-client must be at least 1")
    for pid in args.pid:
        if not proc.exists(pid):
            from pymtrace.errors import ProcessGone

            raise ProcessGone(pid)


def mode(args: argparse.Namespace) -> str:
    """The exporter's mode: "per-call" (every malloc call), "always-on" (none), "budget"
    (the default: the malloc uprobes in windows under --max-overhead)."""
    return "per-call" if args.per_call else "always-on" if args.always_on else "budget"


def _budget_pct(args: argparse.Namespace) -> float:
    return DEFAULT_BUDGET if args.max_overhead is None else args.max_overhead


def build_sources(args: argparse.Namespace) -> list[Sources]:
    """The same collectors as `pymtrace top` (pymtrace.sources.bundle.Sources), attached for the
    exporter's mode: slab + faults + glibc USDT, and the malloc uprobes: in windows under a
    budget (default), always (per-call) or never (always-on)."""
    from pymtrace.sources import bundle

    budget = None
    if mode(args) == "budget":
        from pymtrace.sources.budget import Budget

        budget = Budget(_budget_pct(args), args.window)
    bundle = bundle.Sources(
        pids=args.pid or None, malloc=not args.always_on, slab=True, faults=True, glibc=True, budget=budget
    )
    faults = bundle.sources.get("faults")
    if faults is not None and hasattr(faults, "regions"):
        faults.regions = False  # per-region faults are top's view 3; the exporter has no use for them
    if args.max_processes:  # capacity of the per-process maps, read by attach()
        for name in ("malloc", "faults"):
            c = bundle.sources.get(name)
            if c is not None and hasattr(c, "max_procs"):
                c.max_procs = args.max_processes
    bundle.attach()
    for note in bundle.notes:
        print(f"pymtrace exporter: note: {note}", file=sys.stderr, flush=True)
    return [bundle]


def _close(src: Sources) -> None:
    try:
        src.close()
    except Exception as exc:  # detaching is BCC's (it raises bare Exception); the others still close
        print(f"pymtrace exporter: closing {type(src).__name__} failed: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from pymtrace.bpf import load as bpfload

    _check_args(args)
    web = None
    if args.web_config:  # checked first: a broken file is reported without root or BPF
        from pymtrace.sinks import webconfig

        web = webconfig.load(args.web_config)
    bpfload.require_root("pymtrace exporter")
    name = mode(args)
    server = make_server(
        args.listen,
        None,
        web=web,
        timeout=args.timeout,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        max_per_client=args.max_connections_per_client,
        index_html=INDEX.format(mode=name, label=html.escape(args.label_by), version=__version__),
    )
    stats = None
    sources = []
    try:
        if not args.no_bpf_stats:
            from pymtrace.bpf.stats import BpfStats

            stats = BpfStats()
            if not stats.enable():
                print(
                    "pymtrace exporter: cannot enable BPF run-time stats; program run time will read 0", file=sys.stderr
                )
        sources = build_sources(args)
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        agg = Aggregator(
            label_by=args.label_by, max_series=args.max_series, grace=args.grace, pids=args.pid or None, comm=args.comm
        )
        registry.register(ExporterMetrics(sources, agg, stats, label_by=args.label_by, mode=name))
        server.registry = registry
        host, port = server.server_address[:2]
        scheme = "https" if web and web.ssl_context else "http"
        shown = f"[{host}]" if ":" in host else host
        print(
            f"pymtrace exporter: serving {scheme}://{shown}:{port}/metrics ({name} mode)", file=sys.stderr, flush=True
        )
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        for s in sources:
            _close(s)
        if stats:
            stats.close()
    return 0
