"""top's view 5 (call stacks): the view on synthetic snapshots, and the aggregation of samples
into call sites (collect.stacksites) on synthetic stacks, no BPF needed."""

import json

from support.schema import problems

from pymtrace.sinks import views
from pymtrace.sources.snapshot import StackProcess
from pymtrace.sources.stacksites import OTHER_SITE, SiteAggregator, call_site
from pymtrace.tracee.unwind import Frame, Module

LIBC = Module("/usr/lib/x86_64-linux-gnu/libc.so.6", "aa")
STDCXX = Module("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "bb")
PROG = Module("/opt/app/prog", "cc")
NAMES = {
    (LIBC, 0x10): "malloc",
    (LIBC, 0x20): "__libc_start_main",
    (STDCXX, 0x30): "operator new(unsigned long)",
    (PROG, 0x100): "leaf",
    (PROG, 0x200): "caller",
    (PROG, 0x300): "main",
    (PROG, 0x400): "other_leaf",
}


class FakeSymbolizer:
    def __init__(self):
        self.calls = 0

    def frames(self, loc):
        self.calls += 1
        return [Frame(NAMES[loc])]


# leaf first, as the unwinder gives them
VIA_NEW = ((LIBC, 0x10), (STDCXX, 0x30), (PROG, 0x100), (PROG, 0x200), (PROG, 0x300), (LIBC, 0x20))
DIRECT = ((LIBC, 0x10), (PROG, 0x100), (PROG, 0x300), (LIBC, 0x20))
OTHER = ((LIBC, 0x10), (PROG, 0x400), (PROG, 0x300), (LIBC, 0x20))


def test_call_site_is_the_first_frame_outside_libc_and_libstdcxx():
    assert call_site(VIA_NEW) == (PROG, 0x100)
    assert call_site(DIRECT) == (PROG, 0x100)
    assert call_site(((LIBC, 0x10), (LIBC, 0x20))) == (LIBC, 0x20)  # all in libc: the outermost
    assert call_site(()) is None


def test_aggregator_sites_rates_inuse_and_cap():
    agg = SiteAggregator(sample_bytes=1, max_stacks=2)  # every call: weight 1, exact values
    sym = FakeSymbolizer()
    ts = 10**9
    for i in range(4):
        agg.add_sample(7, i, VIA_NEW, 100, ts, True)
    agg.add_sample(7, 10, DIRECT, 50, ts, True)
    agg.add_sample(7, 11, OTHER, 30, ts, False)  # a third distinct stack: over the cap
    live = {1, 10}  # sample 1 (VIA_NEW) and 10 (DIRECT) still allocated
    snap = agg.snapshot(live, ts + 2 * 10**9, sym, comms=lambda pid: "prog")[7]
    assert problems(snap, StackProcess, "stacks[7]") == []
    site = snap["sites"]["/opt/app/prog+0x100"]
    # two stacks share the call site leaf+0x100: one row, both stacks
    assert (site["function"], site["module"], site["offset"]) == ("leaf", "prog", 0x100)
    assert (site["alloc_objects"], site["alloc_bytes"]) == (5, 450)
    assert (site["inuse_objects"], site["inuse_bytes"]) == (2, 150)
    assert sorted(len(s["frames"]) for s in site["stacks"]) == [4, 6]
    new = next(s for s in site["stacks"] if len(s["frames"]) == 6)
    assert [f["function"] for f in new["frames"]] == [
        "__libc_start_main",
        "main",
        "caller",
        "leaf",
        "operator new(unsigned long)",
        "malloc",
    ]
    other = snap["sites"][OTHER_SITE]
    assert other["alloc_bytes"] == 30 and snap["overflow_samples"] == 1 and snap["stacks_kept"] == 2
    # freed samples older than the grace period are forgotten; symbolizing is not repeated
    calls = sym.calls
    again = agg.snapshot({1}, ts + 2 * 10**9, sym)[7]
    assert again["sites"]["/opt/app/prog+0x100"]["inuse_bytes"] == 100
    assert agg.remembered() == 1  # only the live sample
    assert sym.calls - calls <= 2  # only the site names: frames are kept per stack


def test_aggregator_cuts_at_the_counters_time():
    """until_ns: samples taken after it (while top read its counters) count in the next snapshot,
    so that the view's rates cover the calls top's counters do."""
    agg = SiteAggregator(sample_bytes=1, max_stacks=1)
    sym = FakeSymbolizer()
    ts = 10**9
    agg.add_sample(7, 1, DIRECT, 50, ts, True)
    agg.add_sample(7, 2, DIRECT, 60, ts + 10**6, False)  # after the cut
    agg.add_sample(7, 3, OTHER, 30, ts + 10**6, True)  # after the cut, over the cap
    first = agg.snapshot({1, 2, 3}, ts + 2 * 10**9, sym, until_ns=ts + 1000)[7]
    site = first["sites"]["/opt/app/prog+0x100"]
    assert (site["alloc_objects"], site["alloc_bytes"], site["samples"]) == (1, 50, 1)
    assert (site["inuse_objects"], site["inuse_bytes"]) == (1, 50)
    assert first["sites"][OTHER_SITE]["alloc_bytes"] == 0
    assert (first["samples"], first["complete_samples"], first["overflow_samples"]) == (1, 1, 0)
    assert agg.remembered() == 3  # the later ones are not forgotten, though older than the grace
    second = agg.snapshot({1}, ts + 2 * 10**9, sym, until_ns=ts + 2 * 10**9)[7]
    site = second["sites"]["/opt/app/prog+0x100"]
    assert (site["alloc_objects"], site["alloc_bytes"], site["samples"]) == (2, 110, 2)
    assert (site["inuse_objects"], site["inuse_bytes"]) == (1, 50)
    assert second["sites"][OTHER_SITE]["alloc_bytes"] == 30
    assert (second["samples"], second["complete_samples"], second["overflow_samples"]) == (3, 2, 1)


def _site(function, alloc_bytes, alloc_objects, inuse_bytes, frames, ident=1):
    stack = {
        "id": ident,
        "alloc_objects": alloc_objects,
        "alloc_bytes": alloc_bytes,
        "inuse_objects": inuse_bytes / 100,
        "inuse_bytes": inuse_bytes,
        "samples": 3,
        "complete": True,
        "frames": [{"function": f, "module": "prog", "file": "", "line": 0, "inlined": False} for f in frames],
    }
    values = {k: stack[k] for k in ("alloc_objects", "alloc_bytes", "inuse_objects", "inuse_bytes", "samples")}
    return {"function": function, "module": "prog", "offset": 0x100, **values, "stacks": [stack]}


def _snap(t, scale):
    sites = {
        "/prog+0x100": _site("hot", 10_000 * scale, 100 * scale, 400, ["main", "hot", "malloc"], 1),
        "/prog+0x200": _site("cold", 1_000 * scale, 50 * scale, 0, ["main", "cold", "malloc"], 2),
    }
    entry = {
        "pid": 7,
        "comm": "prog",
        "sample_bytes": 524288,
        "samples": 9,
        "complete_samples": 8,
        "stacks_kept": 2,
        "max_stacks": 500,
        "overflow_samples": 0,
        "sites": sites,
    }
    return {"time": t, "start": 0.0, "processes": {}, "lost": {}, "stacks": {7: entry}}


def test_stacks_view_rates_rows_and_json_stacks():
    prev, cur = _snap(10.0, 1), _snap(12.0, 3)  # 2 s: hot +20000 B, +200 calls
    t = views.build("stacks", prev, cur)
    assert [c.key for c in t.columns][:4] == ["pid", "comm", "site", "module"]
    assert [(r[2], r[4], r[5], r[6], r[7]) for r in t.rows] == [
        ("hot", 10_000.0, 100.0, 400, 30_000),
        ("cold", 1_000.0, 50.0, 0, 3_000),
    ]
    doc = json.loads(json.dumps(views.to_json(t)))
    hot = doc["rows"][0]
    assert hot["alloc_bytes_per_s"] == 10_000 and hot["stacks"][0]["alloc_bytes_per_s"] == 10_000
    assert [f["function"] for f in hot["stacks"][0]["frames"]] == ["main", "hot", "malloc"]
    assert "1 of 9 samples" in " ".join(t.notes)  # incomplete stacks are said
    text = views.text_table(t)
    assert "2 call sites in 1 processes" in text and "main (prog)" in text
    # through JSON (string PIDs) the view is the same
    again = views.build("stacks", json.loads(json.dumps(prev)), json.loads(json.dumps(cur)))
    assert [r[:8] for r in again.rows] == [r[:8] for r in t.rows]


def test_stacks_view_without_the_sampler_says_how_to_enable_it():
    t = views.build(5, None, {"time": 1.0, "processes": {}})
    assert t.rows == [] and t.notes == [views.STACKS_NOT_ENABLED]
