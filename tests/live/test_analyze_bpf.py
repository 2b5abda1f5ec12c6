"""`pymtrace analyze` on real recordings: exact per-type counts through record -> parquet,
record -> mtrace-bin and the conversions, and lifetimes, cross-thread frees and the peak of
live bytes of a workload built to have known values (tests/support/workloads/analyze_lifetimes.c)."""

import json

import pytest
from support.cli import run_pymtrace
from support.recording import ground_truth, text_range

from pymtrace.trace.formats import mtrace_bin as B

pytestmark = pytest.mark.bpf


def analyze(*args):
    proc = run_pymtrace("analyze", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def own_counts(path, lo, hi):
    """Per-type counts of the calls made by the workload's own code (callers in its text)."""
    out = analyze(
        path,
        "--json",
        "--sql",
        f"SELECT type, count(*) AS n FROM calls WHERE caller >= {lo} AND caller < {hi} GROUP BY 1",
    )
    return {r["type"]: r["n"] for r in json.loads(out)}


def test_exact_counts_through_every_path(cbuild, tmp_path):
    prog = cbuild("record_calls", "-no-pie")
    pqf, raw = tmp_path / "calls.parquet", tmp_path / "calls.bin"
    proc = run_pymtrace("record", "--json", "-o", pqf, "--", prog)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    recorded = {k: v for k, v in summary["files"][0]["counts"].items() if v}
    truth = ground_truth(proc.stdout)
    want = {}
    for t in truth:
        want[B.TYPE_NAMES[t[1]]] = want.get(B.TYPE_NAMES[t[1]], 0) + 1
    lo, hi = text_range(prog)

    rep = json.loads(analyze(pqf, "--json"))
    assert {n: c["count"] for n, c in rep["calls"].items()} == recorded
    assert rep["totals"]["events"] == summary["entries"]
    assert own_counts(pqf, lo, hi) == want
    own = json.loads(
        analyze(pqf, "--json", "--sql", f"SELECT count(*) AS n FROM calls WHERE caller >= {lo} AND caller < {hi}")
    )
    assert own[0]["n"] == len(truth)
    # the workload's own leaks (calloc 300, aligned_alloc 512, pvalloc 5000, malloc 77) are never freed
    leaked = {c["caller"]: c for c in rep["never_freed"]["by_caller"]}
    assert sum(c["requested_bytes"] for a, c in leaked.items() if lo <= int(a, 16) < hi) >= 300 + 512 + 5000 + 77
    assert rep["lifetimes"]["cross_thread_frees"] >= 6  # three blocks each way between main and the workers

    run_pymtrace("convert", pqf, raw, "--to", "mtrace-bin", check=True)
    back = tmp_path / "back.parquet"
    run_pymtrace("convert", raw, back, "--to", "parquet", check=True)
    for path in (raw, back):
        again = json.loads(analyze(path, "--json"))
        assert {n: c["count"] for n, c in again["calls"].items()} == recorded
        assert {k: again[k] for k in ("live", "lifetimes", "never_freed")} == {
            k: rep[k] for k in ("live", "lifetimes", "never_freed")
        }
    assert own_counts(raw, lo, hi) == want


def test_known_lifetimes_and_peak(cbuild, tmp_path):
    prog = cbuild("analyze_lifetimes", "-no-pie")
    out = tmp_path / "life.parquet"
    proc = run_pymtrace("record", "-q", "-o", out, "--", prog)
    assert proc.returncode == 0, proc.stderr
    facts = {line.split()[1]: int(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("FACT ")}
    rep = json.loads(analyze(out, "--json"))
    assert rep["live"]["peak_bytes"] == facts["peak"]
    life = rep["lifetimes"]
    long_lived = sum(h["count"] for h in life["histogram"][6:])  # the classes from 100 ms up
    assert long_lived == facts["long_lived"]
    assert life["max_ns"] >= facts["sleep_ns"] and life["p50_ns"] < 10**8
    assert life["cross_thread_frees"] >= facts["cross"]
    lo, hi = text_range(prog)
    assert own_counts(out, lo, hi) == {"malloc": facts["mallocs"], "free": facts["frees"]}
    html = tmp_path / "life.html"
    analyze(out, "--html", html)
    assert f"{facts['peak']:,}" in html.read_text()
