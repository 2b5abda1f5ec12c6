"""pymtrace.sources.snapshot: the one merge (top's Sources and the exporter both use it)
and the schema, checked against the snapshots the merge and `top --json` produce."""

import copy
import io
import json
import sys
import time

from support.schema import problems

from pymtrace.sources import snapshot
from pymtrace.sources.bundle import Sources


def malloc_entry(pid, comm, malloc=0, exited=False):
    calls = dict.fromkeys(snapshot.CALLS, 0)
    calls["malloc"] = malloc
    return {
        "pid": pid,
        "comm": comm,
        "calls": calls,
        "requested_bytes": 10 * malloc,
        "allocated_bytes": 32 * malloc,
        "freed_bytes": 0,
        "live_bytes": 32 * malloc,
        "failed": 0,
        "size_log2": [0] * 65,
        "exited": exited,
    }


def fault_entry(pid, comm, user=0, kernel=0, exited=False):
    return {"pid": pid, "comm": comm, "faults_user": user, "faults_kernel": kernel, "exited": exited}


def glibc_entry(pid, comm):
    return {
        "pid": pid,
        "comm": comm,
        "alive": True,
        "libc": "/opt/glibc/lib/libc.so.6",
        "probes": 29,
        "reason": None,
        "events": 7,
        "arenas": 2,
        "arenas_created": 1,
        "arena_reuse": 0,
        "arena_reuse_free_list": 0,
        "arena_lock_waits": 3,
        "arena_list": [{"arena": "0x7f00", "creator_tid": 12, "attaches": 1, "waits": 3}],
        "heaps": 1,
        "heap_bytes": 135168,
        "heap_bytes_max": 135168,
        "heaps_created": 1,
        "heaps_freed": 0,
        "heap_grow": 0,
        "heap_shrink": 0,
        "heap_list": [{"heap": "0x7f00", "size": 135168}],
        "sbrk_bytes": 1 << 20,
        "sbrk_grow_count": 2,
        "sbrk_trimmed_bytes": 0,
        "sbrk_trim_count": 0,
        "sbrk_failed": 0,
        "dyn_threshold_changes": 0,
        "mallopt_calls": 0,
        "tcache_double_free_scans": 0,
        "retries": {"malloc": 0, "realloc": 0, "calloc": 0, "memalign": 0, "arena": 0},
        "lock_waits": {12: 3},
        "threads": {
            12: {"lock_waits": 3, "arena": "0x7f00", "arena_switches": 1},
            13: {"lock_waits": 0, "arena": None, "arena_switches": 0},
        },
        "params": {"mmap_threshold": {"value": 131072, "cause": "initial", "source": "memory"}},
        "mmap_threshold": 131072,
        "trim_threshold": None,
    }


def glibc_part(pid, comm, lost=0):
    return {
        "glibc": {pid: glibc_entry(pid, comm)},
        "lost": {"glibc_events": lost},
        "glibc_collector": {
            "lost_events": lost,
            "map_full": {"threads": 2},
            "libcs": [
                {"libc": "/opt/glibc/lib/libc.so.6", "probes": 29, "sites": 37, "attached": True, "reason": None}
            ],
            "warnings": [],
        },
    }


def malloc_part():
    return {
        "time": 10.5,
        "start": 1.5,
        "processes": {7: malloc_entry(7, "seven", malloc=5), 8: malloc_entry(8, "eight", malloc=1)},
        "lost": {"malloc_full": 2},
        "maps": {"ms_stats": {"entries": 2, "max_entries": 8192, "evicted": 0}},
    }


def fault_part():
    return {
        "time": 10.6,
        "start": 1.4,
        "processes": {7: fault_entry(7, "seven", user=4, exited=True), 9: fault_entry(9, "nine", kernel=1)},
        "lost": {"fault_full": 1},
        "maps": {"pf_totals": {"entries": 2, "max_entries": 16384, "evicted": 1}},
        "fault_regions": {7: {"[heap]": 3, "/usr/lib/libc.so.6": 1}},
    }


def slab_part():
    return {
        "time": 10.4,
        "start": 1.6,
        "slab": {"filp": {"allocs": 10, "frees": 8, "bytes_alloc": 2560, "bytes_req": 2400}},
        "slab_source": "tracepoint name",
        "lost": {"slab_full": 0},
        "maps": {"slab_stats": {"entries": 1, "max_entries": 2048}},
    }


def test_merge_of_one_bundles_sources():
    parts = [malloc_part(), fault_part(), slab_part(), glibc_part(7, "seven", lost=4)]
    before = copy.deepcopy(parts)
    snap = snapshot.merge(parts)
    assert parts == before  # parts are not modified
    assert list(snap)[:4] == ["time", "start", "processes", "lost"]
    assert snap["time"] == 10.4 and snap["start"] == 1.4  # both the earliest
    # one entry per process, with every source's keys; exited when any part says so
    p7 = snap["processes"][7]
    assert p7["calls"]["malloc"] == 5 and p7["faults_user"] == 4 and p7["exited"] is True
    assert snap["processes"][8]["exited"] is False and "faults_user" not in snap["processes"][8]
    assert snap["processes"][9] == fault_entry(9, "nine", kernel=1)  # in one source only: as it is
    assert snap["lost"] == {"malloc_full": 2, "fault_full": 1, "slab_full": 0, "glibc_events": 4}
    assert set(snap["maps"]) == {"ms_stats", "pf_totals", "slab_stats"}
    assert snap["glibc_collector"]["lost_events"] == 4
    assert problems(snap) == []


def test_merge_sums_lost_counts_of_independent_sources_and_unites_errors():
    a = {"processes": {"7": malloc_entry(7, "seven", malloc=5)}, "lost": {"malloc_full": 2}, "errors": {"slab": "x"}}
    b = {
        "processes": {8: malloc_entry(8, "eight")},
        "lost": {"malloc_full": 3, "fault_full": 1},
        "errors": {"glibc": "y"},
    }
    snap = snapshot.merge([a, b])
    assert snap["lost"] == {"malloc_full": 5, "fault_full": 1}
    assert snap["errors"] == {"slab": "x", "glibc": "y"}
    assert sorted(snap["processes"]) == [7, 8]  # PID keys are ints, whatever the part used
    assert snap["time"] is None and snap["start"] is None  # no part had one
    assert snapshot.merge([]) == {"time": None, "start": None, "processes": {}, "lost": {}}


def test_sources_snapshot_is_the_merge_and_fits_the_schema():
    class Fake:
        def __init__(self, part=None, fail=None, contained=False):
            # contained: its failures are recorded in errors, not raised (GlibcSource's rule)
            self.part, self.fail, self.contained = part, fail, contained

        def snapshot(self):
            if self.fail:
                raise self.fail
            return copy.deepcopy(self.part)

    bundle = Sources(malloc=False, slab=False, faults=False, glibc=False)
    bundle.start = 1.0
    bundle.sources = {"faults": Fake(fault_part()), "slab": Fake(slab_part()), "glibc": Fake(glibc_part(9, "nine"))}
    before = time.monotonic()
    snap = bundle.snapshot()
    # the bundle's attach; when reading began (not after: the first parts were read then)
    assert snap["start"] == 1.0 and before <= snap["time"] <= time.monotonic()
    assert snap["lost"] == {"fault_full": 1, "slab_full": 0, "glibc_events": 0}
    assert problems(snap) == []
    # a failing glibc source is reported, the rest goes on
    bundle.sources["glibc"] = Fake(fail=RuntimeError("boom"), contained=True)
    snap = bundle.snapshot()
    assert snap["errors"] == {"glibc": "RuntimeError: boom"} and "glibc" not in snap
    assert list(snap)[-1] == "errors"
    assert problems(snap) == []


def test_top_json_snapshot_fits_the_schema(monkeypatch):
    """What `top --json` prints (pymtrace.sinks.batch.Reporter), read back from JSON."""
    from pymtrace.sinks.batch import BatchOptions, Reporter

    prev = snapshot.merge([malloc_part(), fault_part(), slab_part(), glibc_part(7, "seven")])
    cur = copy.deepcopy(prev)
    cur["time"] += 1.0
    cur["processes"][7]["calls"]["malloc"] += 10
    cur["notes"] = ["a note"]
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    Reporter(BatchOptions(interval=1.0, json=True), ["processes", "totals", "slab", "faults", "glibc"], []).report(
        prev, cur
    )
    doc = json.loads(out.getvalue())
    assert problems(doc["snapshot"], json_keys=True) == []
    assert doc["views"]["totals"]["rows"][0]["malloc"] == 15
    assert doc["views"]["processes"]["rows"][0]["malloc_per_s"] == 10.0


def test_checker_reports_what_does_not_fit():
    snap = snapshot.merge([malloc_part()])
    snap["processes"][7]["calls"]["malloc"] = "5"
    snap["processes"][7]["bogus"] = 1
    del snap["processes"][8]["comm"]
    snap["slab"] = {"filp": {"allocs": 1}}
    found = problems(snap)
    assert any("processes[7].calls['malloc']" in p for p in found), found
    assert any("'bogus' not in ProcessEntry" in p for p in found), found
    assert any("missing 'comm'" in p for p in found), found
    assert any("missing 'bytes_alloc'" in p for p in found), found


def test_exporter_merges_its_sources_with_the_same_rule():
    from pymtrace.commands import exporter

    class Source:
        def __init__(self, part):
            self.part = part

        def snapshot(self):
            return copy.deepcopy(self.part)

    a = snapshot.merge([malloc_part(), glibc_part(7, "seven", lost=4)])
    b = snapshot.merge([fault_part(), slab_part()])
    b["lost"]["malloc_full"] = 3  # a second source's own counter of the same cause
    b["errors"] = {"faults": "no tracepoint"}
    col = exporter.ExporterMetrics([Source(a), Source(b)], exporter.Aggregator(alive=lambda p: True))
    snap = col.snapshot()
    assert snap["lost"]["malloc_full"] == 5  # summed, as top does
    # the glibc ring buffer's losses once, under the source's own cause name
    assert snap["lost"]["glibc_events"] == 4 and "glibc_ringbuf" not in snap["lost"]
    assert snap["lost"]["glibc_threads_full"] == 2
    assert snap["processes"][9]["faults_kernel"] == 1  # in one source only
    assert snap["processes"][7]["exited"] is True and snap["processes"][7]["calls"]["malloc"] == 5
    assert snap["errors"] == {"faults": "no tracepoint"}


def test_call_names_in_top_s_display_order():
    """The display order of the calls (top's columns) is the one top always printed."""
    order = ("malloc", "calloc", "realloc", "free", "free_null", "memalign", "posix_memalign", "valloc", "pvalloc")
    cxx = ("new", "new_array", "new_nothrow", "new_aligned", "delete", "delete_array", "delete_sized", "delete_aligned")
    assert snapshot.CALLS == order + cxx  # C++'s operator new/delete after the C calls
    assert snapshot.ALLOC_CALLS == tuple(c for c in order + cxx if c not in ("free", "free_null") + cxx[4:])
