"""pymtrace.sources.bundle.Sources without BPF: every source runs through the same
lifecycle, and the bundle treats them by their declared policy (required, contained)."""

import pytest

from pymtrace.errors import PymtraceError
from pymtrace.sources import base, bundle
from pymtrace.sources.glibc import GlibcSource


def test_every_source_is_a_source():
    cs = bundle.Sources(malloc=True, slab=True, faults=True, glibc=True, track_exits=False)
    assert list(cs.sources) == ["malloc", "faults", "slab", "glibc"]
    assert all(isinstance(c, base.Source) for c in cs.sources.values())
    assert [n for n, c in cs.sources.items() if c.required] == ["malloc"]
    assert [n for n, c in cs.sources.items() if c.contained] == ["glibc"]
    order = sorted(cs.sources, key=lambda n: cs.sources[n].attach_order)
    assert order[0] == "glibc" and order[-1] == "malloc"


@pytest.mark.parametrize("failure", [PymtraceError("no libc here"), RuntimeError("a bug")])
def test_a_contained_source_failure_is_reported_not_raised(monkeypatch, failure):
    def prepare(self):
        raise failure

    monkeypatch.setattr(GlibcSource, "prepare", prepare)
    cs = bundle.Sources(malloc=False, slab=False, faults=False, glibc=True, track_exits=False)
    with cs:
        snap = cs.snapshot()
    assert "glibc" not in cs.sources
    expected = str(failure) if isinstance(failure, PymtraceError) else f"RuntimeError: {failure}"
    assert snap["errors"] == {"glibc": expected}


def test_a_source_with_nothing_to_compile_stays_and_reports(monkeypatch):
    """glibc on a libc without probes: nothing to compile, kept so that view 4 says why."""

    def prepare(self):
        base.Source.prepare(self)  # no sites found, no faults wanted

    monkeypatch.setattr(GlibcSource, "prepare", prepare)
    cs = bundle.Sources(malloc=False, slab=False, faults=False, glibc=True, track_exits=False)
    with cs:
        assert cs.bpf is None and cs.sources["glibc"].part() is None
        assert "glibc" in cs.sources and not cs.errors
