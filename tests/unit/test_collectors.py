"""pymtrace.collect.base.Collectors without BPF: every collector runs through the same
lifecycle, and the bundle treats them by their declared policy (required, contained)."""

import pytest

from pymtrace.collect import base
from pymtrace.collect.glibc import GlibcCollector
from pymtrace.errors import PymtraceError


def test_every_collector_is_a_collector():
    cs = base.Collectors(malloc=True, slab=True, faults=True, glibc=True, track_exits=False)
    assert list(cs.collectors) == ["malloc", "faults", "slab", "glibc"]
    assert all(isinstance(c, base.Collector) for c in cs.collectors.values())
    assert [n for n, c in cs.collectors.items() if c.required] == ["malloc"]
    assert [n for n, c in cs.collectors.items() if c.contained] == ["glibc"]
    order = sorted(cs.collectors, key=lambda n: cs.collectors[n].attach_order)
    assert order[0] == "glibc" and order[-1] == "malloc"


@pytest.mark.parametrize("failure", [PymtraceError("no libc here"), RuntimeError("a bug")])
def test_a_contained_collector_failure_is_reported_not_raised(monkeypatch, failure):
    def prepare(self):
        raise failure

    monkeypatch.setattr(GlibcCollector, "prepare", prepare)
    cs = base.Collectors(malloc=False, slab=False, faults=False, glibc=True, track_exits=False)
    with cs:
        snap = cs.snapshot()
    assert "glibc" not in cs.collectors
    expected = str(failure) if isinstance(failure, PymtraceError) else f"RuntimeError: {failure}"
    assert snap["errors"] == {"glibc": expected}


def test_a_collector_with_nothing_to_compile_stays_and_reports(monkeypatch):
    """glibc on a libc without probes: nothing to compile, kept so that view 4 says why."""

    def prepare(self):
        base.Collector.prepare(self)  # no sites found, no faults wanted

    monkeypatch.setattr(GlibcCollector, "prepare", prepare)
    cs = base.Collectors(malloc=False, slab=False, faults=False, glibc=True, track_exits=False)
    with cs:
        assert cs.bpf is None and cs.collectors["glibc"].part() is None
        assert "glibc" in cs.collectors and not cs.errors
