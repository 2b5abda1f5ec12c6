"""`heap -p --max-overhead` without BPF: how a profile sampled in windows is scaled up to the
whole run (window_scales, WindowedProfile with real MeasuredParts), what its formats offer,
and the options' errors. Against a real process: tests/live/test_heap_budget_bpf.py."""

import gzip
import io
import random

import pytest
from support.cli import run_pymtrace
from support.heapprofile import STACKS, FakeSymbolizer

from pymtrace.sinks import profile_pb2
from pymtrace.sinks.flamegraph import render_html
from pymtrace.sinks.folded import folded_lines
from pymtrace.sinks.heap_text import render_text
from pymtrace.sinks.pprof import write_pprof
from pymtrace.sources.budget import MeasuredParts
from pymtrace.sources.heapprofile import ALLOC_TYPES, WindowedProfile, estimate_error, window_scales

S = 1_000_000_000  # ns


def test_each_window_stands_for_the_time_nearest_it():
    """Parts at 10-11 s and 20-22 s of a run from 0 to 40 s: the first stands for 0 to 15.5 s
    (halfway to the next), the second for 15.5 to 40 s; together, the whole run."""
    parts = [(10 * S, 11 * S), (20 * S, 22 * S)]
    scales = window_scales(parts, 0, 40 * S)
    assert scales == pytest.approx([15.5, 24.5 / 2])
    assert sum(k * (b - a) for k, (a, b) in zip(scales, parts)) == pytest.approx(40 * S)


def _true_and_estimated(rate, windows):
    """The bytes RATE(t) allocates over 0-100 s, and their estimate from WINDOWS ((start,
    end) s) counting every byte in them, scaled as the profile scales them."""
    steps = 100_000
    truth = sum(rate(i / 1000) for i in range(steps)) / 1000
    counted = [sum(rate(a + (b - a) * (j + 0.5) / 100) for j in range(100)) * (b - a) / 100 for a, b in windows]
    scales = window_scales([(a * S, b * S) for a, b in windows], 0, 100 * S)
    return truth, sum(c * k for c, k in zip(counted, scales))


def test_scaling_follows_a_rate_that_changes_where_windows_come_more_often():
    """A rate that steps up four-fold half way, with windows coming three times as often in
    the busy half (their credit is earned faster there): windows nearest each instant keep
    the estimate within 3 %, where one factor for the whole run (its length over the
    windows' time) would weigh the busy half by how often windows came there (+17 % here)."""
    rng = random.Random(7)

    def rate(t):
        return 100.0 if t < 50 else 400.0

    windows, t = [], rng.uniform(0, 1)
    while t < 99:
        windows.append((t, t + 0.5))
        t += 0.5 + rng.uniform(0, 6 if t < 50 else 2)
    truth, estimate = _true_and_estimated(rate, windows)
    assert estimate == pytest.approx(truth, rel=0.03)
    covered = sum(b - a for a, b in windows)
    naive = sum(
        _true_and_estimated(rate, [w])[1] / window_scales([(w[0] * S, w[1] * S)], 0, 100 * S)[0] for w in windows
    )
    assert naive * 100 / covered > 1.1 * truth


def test_a_steady_rate_is_estimated_exactly_whatever_the_windows():
    rng = random.Random(3)
    windows, t = [], rng.uniform(0, 2)
    while t < 98:
        windows.append((t, t + rng.uniform(0.1, 1)))
        t = windows[-1][1] + rng.uniform(0.1, 5)
    truth, estimate = _true_and_estimated(lambda t: 250.0, windows)
    assert estimate == pytest.approx(truth, rel=1e-6)


def test_measured_parts_place_samples_in_open_and_closed_parts():
    parts = MeasuredParts()
    a = parts.begin()
    assert parts.part_of(a - 1) is None and parts.part_of(a + 10 * S) == 0  # open: any later time
    b = parts.end()
    assert parts.part_of(b) == 0 and parts.part_of(b + 1) is None
    c = parts.begin()
    assert parts.part_of(c) == 1 and parts.parts(c + 5) == [(a, b), (c, c + 5)]
    unkept = MeasuredParts(keep=False)  # top's and the exporter's windows: the clock only
    assert unkept.begin() <= unkept.end() and unkept.parts(0) == []


def _windowed_profile():
    """Two windows' parts, real: samples of the "chain" and "leak" stacks (sample_bytes 1:
    weight 1) in each, one taken between them (left out); the run from the parts' start to 3
    parts' lengths after the second ends."""
    parts = MeasuredParts()
    a0 = parts.begin()
    b0 = parts.end()
    a1 = parts.begin()
    b1 = parts.end()
    profile = WindowedProfile(1, parts, {"pids": [42]})
    profile.add(1, STACKS["chain"], 100, a0, True)
    profile.add(2, STACKS["leak"], 4000, b0, True)
    profile.add(3, STACKS["chain"], 100, (b0 + a1) // 2 if a1 > b0 + 1 else b0 + 1, True)  # between: not counted
    profile.add(4, STACKS["chain"], 300, a1, True)
    end = b1 + 3 * (b1 - a1)
    scales = window_scales([(a0, b0), (a1, b1)], parts.start_ns, end)
    profile.meta["budget"] = {
        "max_overhead_pct": 5.0,
        "overhead_pct": 1.5,
        "traced_cpu_seconds": 2.0,
        "cost_seconds": {"traps": 0.01, "bpf": 0.002, "attach_detach": 0.02},
        "trap_ns_per_run": 900.0,
        "probes": "uprobe_multi link",
        "errors": [],
    }
    profile.finish(set(), end)
    return profile, scales


def test_a_windowed_profile_scales_alloc_values_and_offers_no_in_use_ones():
    profile, scales = _windowed_profile()
    by_stack = {entry.stack: entry for entry in profile.stacks()}
    chain, leak = by_stack[STACKS["chain"]], by_stack[STACKS["leak"]]
    assert chain.alloc_space == pytest.approx(100 * scales[0] + 300 * scales[1])
    assert chain.alloc_objects == pytest.approx(scales[0] + scales[1])
    assert leak.alloc_space == pytest.approx(4000 * scales[0])
    assert chain.inuse_space == leak.inuse_space == 0
    assert profile.samples == 3 and profile.outside == 1
    assert profile.value_types == ALLOC_TYPES and profile.default_value == "alloc_space"
    lines = profile.summary_lines()
    assert lines[0].startswith("ESTIMATE: alloc_objects and alloc_space scaled up from the samples of 2 windows")
    assert "in-use values not measured" in lines[0]
    assert any("measured cost 1.50%" in line and "5% of the traced" in line for line in lines)
    assert any(line.startswith("samples left out: 1") for line in lines)
    assert profile.error is not None and any(line.startswith("error (95 %) of the total: +-") for line in lines)


def test_the_error_is_the_counts_and_the_spread_of_the_windows_paces():
    """400 samples in one window: the count's 1.96/20; in four windows of one pace, still the
    count's; paces of 50, 100, 150 and 100 a second: the spread of their mean on top."""
    assert estimate_error([(400, S)]) == pytest.approx(1.96 / 20)
    assert estimate_error([(100, S)] * 4) == pytest.approx(1.96 / 20)
    moving = estimate_error([(50, S), (100, S), (150, S), (100, S)])
    cv = 40.8248290463863 / 100  # stdev of 50, 100, 150, 100 over their mean
    assert moving == pytest.approx(((1.96 / 20) ** 2 + (1.96 * cv) ** 2 / 4) ** 0.5)
    assert estimate_error([(0, S)]) is None


def test_the_formats_hold_the_alloc_values_only():
    profile, _ = _windowed_profile()
    symbolizer = FakeSymbolizer()
    out = io.BytesIO()
    write_pprof(profile, symbolizer, out)
    message = profile_pb2.Profile.FromString(gzip.decompress(out.getvalue()))
    types = [message.string_table[t.type] for t in message.sample_type]
    assert types == list(ALLOC_TYPES)
    assert message.string_table[message.default_sample_type] == "alloc_space"
    assert all(len(s.value) == 2 for s in message.sample)
    assert any("ESTIMATE" in message.string_table[c] for c in message.comment)
    text = render_text(profile, symbolizer, value="alloc_space")
    assert "ESTIMATE" in text and "allocated" in text
    with pytest.raises(ValueError):
        render_text(profile, symbolizer, value="inuse_space")
    page = render_html(profile, symbolizer, value="alloc_space")
    assert "ESTIMATE" in page and "inuse_space" not in page
    lines = folded_lines(profile, symbolizer, "alloc_space")  # each line rounded
    assert sum(lines.values()) == pytest.approx(sum(e.alloc_space for e in profile.stacks()), abs=len(lines))


@pytest.mark.parametrize(
    "args, says",
    [
        (("--max-overhead", "0", "-p", "1"), "--max-overhead must be"),
        (("--max-overhead", "5", "--window", "0.001", "-p", "1"), "--window must be"),
        (("--window", "2", "-p", "1"), "--window needs --max-overhead"),
        (("--max-overhead", "5", "--", "true"), "give -p PID"),
        (("--max-overhead", "5", "--value", "inuse_space", "-p", "1"), "in-use values"),
        (("--max-overhead", "5", "--older", "3", "-p", "1"), "--older"),
        (("--max-overhead", "5", "--max-live", "10", "-p", "1"), "--max-live"),
        # every call sampled is still windows: the options pass, the missing process is the error
        (("--max-overhead", "5", "--sample-bytes", "1", "-p", "999999999"), "999999999"),
    ],
)
def test_option_errors_are_one_line(tmp_path, args, says):
    r = run_pymtrace("heap", "-o", str(tmp_path / "x.txt"), *args)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_says_what_each_mode_costs():
    text = " ".join(run_pymtrace("heap", "--help").stdout.split())
    assert "--max-overhead" in text and "every call traps" in text and "calibrated" in text
