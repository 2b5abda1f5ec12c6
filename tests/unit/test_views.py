"""views.py: pure functions from two snapshots to tables (no BPF needed)."""

import json

import pytest

from pymtrace.sinks import views
from pymtrace.sinks.text import human_bytes, human_count


def proc(
    pid,
    comm,
    t=0,
    malloc=0,
    calloc=0,
    realloc=0,
    free=0,
    memalign=0,
    posix_memalign=0,
    valloc=0,
    pvalloc=0,
    requested=0,
    live=0,
    fu=0,
    fk=0,
):
    return {
        "pid": pid,
        "comm": comm,
        "calls": {
            "malloc": malloc,
            "calloc": calloc,
            "realloc": realloc,
            "free": free,
            "free_null": 0,
            "memalign": memalign,
            "posix_memalign": posix_memalign,
            "valloc": valloc,
            "pvalloc": pvalloc,
        },
        "requested_bytes": requested,
        "allocated_bytes": requested,
        "freed_bytes": 0,
        "live_bytes": live,
        "failed": 0,
        "size_log2": [0] * 64,
        "faults_user": fu,
        "faults_kernel": fk,
    }


PREV = {
    "time": 100.0,
    "processes": {
        10: proc(10, "alpha", malloc=100, calloc=10, free=50, requested=10_000, live=4096, fu=5),
        20: proc(20, "beta", malloc=1000, realloc=5, free=900, requested=64_000, live=1 << 20, fu=100, fk=1),
    },
    "slab": {
        "filp": {"allocs": 100, "frees": 90, "bytes_alloc": 25_600, "bytes_req": 23_200},
        "dentry": {"allocs": 10, "frees": 0, "bytes_alloc": 1920, "bytes_req": 1920},
    },
    "fault_regions": {10: {"[heap]": 3, "anon": 2}, 20: {"/usr/lib/libc.so.6": 40, "[stack]": 60}},
    "glibc": {},
}

CUR = {
    "time": 102.0,
    "processes": {
        10: proc(
            10,
            "alpha",
            malloc=300,
            calloc=30,
            free=250,
            memalign=4,
            posix_memalign=6,
            requested=30_000,
            live=8192,
            fu=25,
        ),
        20: proc(20, "beta", malloc=1100, realloc=25, free=1000, requested=76_000, live=2 << 20, fu=110, fk=3),
        30: proc(30, "gamma", malloc=7, requested=700, live=700),
    },
    "slab": {
        "filp": {"allocs": 300, "frees": 280, "bytes_alloc": 76_800, "bytes_req": 69_600},
        "dentry": {"allocs": 14, "frees": 2, "bytes_alloc": 2688, "bytes_req": 2688},
    },
    "fault_regions": {10: {"[heap]": 13, "anon": 12}, 20: {"/usr/lib/libc.so.6": 40, "[stack]": 70}},
    "glibc": {},
    "lost": {"malloc": 0, "faults": 3},
}


def row_dict(table, pid_key="pid"):
    keys = [c.key for c in table.columns]
    return [dict(zip(keys, r)) for r in table.rows]


def test_processes_rates_and_means():
    t = views.build(1, PREV, CUR)
    assert t.view == "processes" and t.interval == 2.0
    rows = {r["pid"]: r for r in row_dict(t)}
    a = rows[10]
    assert a["comm"] == "alpha"
    assert a["malloc_per_s"] == 100.0
    assert a["calloc_per_s"] == 10.0
    assert a["free_per_s"] == 100.0
    assert a["memalign_per_s"] == 5.0  # memalign + posix_memalign family
    assert a["requested_bytes_per_s"] == 10_000.0
    # 20000 bytes over 200 + 20 + 10 allocating calls
    assert a["mean_size"] == pytest.approx(20_000 / 230)
    assert a["live_bytes"] == 8192
    assert a["faults_per_s"] == 10.0
    b = rows[20]
    assert b["realloc_per_s"] == 10.0 and b["faults_per_s"] == 6.0
    # a process new since PREV counts from zero
    assert rows[30]["malloc_per_s"] == 3.5 and rows[30]["mean_size"] == 100
    # default sort: malloc/s descending
    assert [r[0] for r in t.rows] == [10, 20, 30]
    assert t.totals["processes"] == 3
    assert t.lost == {"faults": 3}


def test_sort_column_and_reverse_change_order():
    by_live = views.build("processes", PREV, CUR, sort="live_bytes")
    assert [r[0] for r in by_live.rows] == [20, 10, 30]
    asc = views.build("processes", PREV, CUR, sort="live_bytes", reverse=False)
    assert [r[0] for r in asc.rows] == [30, 10, 20]
    by_comm = views.build("processes", PREV, CUR, sort="comm", reverse=False)
    assert [r[1] for r in by_comm.rows] == ["alpha", "beta", "gamma"]
    # sort index wraps around the columns (the UI's left/right keys)
    wrap = views.build("processes", PREV, CUR, sort=len(views.PROCESS_COLUMNS))
    assert wrap.sort == 0


def test_first_snapshot_without_prev_uses_interval():
    t = views.build(1, None, CUR, interval=4.0)
    rows = {r["pid"]: r for r in row_dict(t)}
    assert rows[10]["malloc_per_s"] == 75.0


def test_json_round_trip_string_pids():
    # a snapshot that went through JSON has string PIDs
    prev = json.loads(json.dumps(PREV))
    cur = json.loads(json.dumps(CUR))
    t = views.build(1, prev, cur)
    assert {r[0] for r in t.rows} == {10, 20, 30}
    assert views.build(1, PREV, CUR).rows == t.rows


def test_slab_view():
    t = views.build(2, PREV, CUR)
    rows = {r["cache"]: r for r in row_dict(t)}
    assert rows["filp"] == {
        "cache": "filp",
        "allocs_per_s": 100.0,
        "frees_per_s": 95.0,
        "bytes_per_s": 25_600.0,
        "net_objects": 20,
    }
    assert rows["dentry"]["net_objects"] == 12
    assert t.rows[0][0] == "filp"  # most allocs/s first


def test_faults_view_groups_regions_under_process():
    t = views.build(3, PREV, CUR)
    rows = row_dict(t)
    # process 10 has 10 faults/s, process 20 has 6/s: 10's group first
    assert [(r["pid"], r["region"]) for r in rows] == [
        (10, "(all)"),
        (10, "[heap]"),
        (10, "anon"),
        (20, "(all)"),
        (20, "[stack]"),
        (20, "/usr/lib/libc.so.6"),
    ]
    assert rows[0]["faults_per_s"] == 10.0 and rows[0]["faults"] == 25
    assert rows[1]["faults_per_s"] == 5.0 and rows[1]["faults"] == 13
    assert rows[3]["kernel_per_s"] == 1.0
    # sorting by REGION ascending sorts inside groups, groups by their leading row
    t2 = views.build(3, PREV, CUR, sort="pid", reverse=False)
    assert [r[0] for r in t2.rows] == [10, 10, 10, 20, 20, 20]
    t3 = views.build(3, PREV, CUR, sort="pid", reverse=True)
    assert [r[0] for r in t3.rows] == [20, 20, 20, 10, 10, 10]
    assert t3.leaders[0] and t3.leaders[3]
    # formatted: region rows are indented and leave PID/COMM blank
    cells = views.format_rows(t)
    assert cells[0][0] == "10" and cells[1][0] == "" and cells[1][2] == "  [heap]"
    js = views.to_json(t)
    assert js["rows"][0]["kind"] == "process" and js["rows"][1]["kind"] == "region"


GLIBC_CUR = dict(
    CUR,
    glibc={
        10: {
            "arenas": 3,
            "heaps": 2,
            "heap_bytes": 135168,
            "sbrk_bytes": 1 << 20,
            "mmap_threshold": 65536,
            "trim_threshold": 131072,
            "lock_waits": {"11": 4, "12": 10},
        },
        20: {"probes": 0, "libc": "/usr/lib/x86_64-linux-gnu/libc.so.6", "reason": "built without --enable-systemtap"},
    },
)
GLIBC_PREV = dict(PREV, glibc={10: {"arenas": 1, "lock_waits": {"11": 2}}})


def test_glibc_view_with_and_without_probes():
    t = views.build(4, GLIBC_PREV, GLIBC_CUR)
    rows = row_dict(t)
    assert rows[0]["pid"] == 10 and rows[0]["arenas"] == 3 and rows[0]["heaps"] == 2
    assert rows[0]["mmap_threshold"] == 65536 and rows[0]["sbrk_bytes"] == 1 << 20
    assert rows[0]["lock_waits"] == 14 and rows[0]["lock_waits_per_s"] == 6.0
    threads = {r["tid"]: r for r in rows[1:]}
    assert threads["11"]["lock_waits"] == 4 and threads["11"]["lock_waits_per_s"] == 1.0
    assert threads["12"]["lock_waits_per_s"] == 5.0
    assert all(r["pid"] != 20 for r in rows)
    assert len(t.notes) == 1
    note = t.notes[0]
    assert "PID 20 (beta)" in note and "no malloc USDT probes" in note and "/usr/lib/x86_64-linux-gnu/libc.so.6" in note
    text = views.text_table(t)
    assert note in text and "64.0 KiB" in text
    js = views.to_json(t)
    assert js["rows"][0]["mmap_threshold"] == 65536 and "tid" not in js["rows"][0]
    assert js["rows"][1] == {
        "pid": 10,
        "tid": "11",
        "comm": "alpha",
        "lock_waits": 4,
        "lock_waits_per_s": 1.0,
        "kind": "thread",
    }


def test_glibc_unknown_threshold_is_blank_not_zero():
    cur = dict(CUR, glibc={10: {"probes": 29, "arenas": 1, "heaps": 0, "mmap_threshold": None, "lock_waits": {}}})
    t = views.build(4, None, cur)
    cells = views.format_rows(t)[0]
    mi = t.column_index("mmap_threshold")
    assert cells[mi] == "" and cells[t.column_index("arenas")] == "1"
    js = views.to_json(t)
    assert js["rows"][0]["mmap_threshold"] is None and js["rows"][0]["trim_threshold"] is None


def test_glibc_notes_for_missing_libc_and_reasons():
    cur = dict(
        CUR,
        glibc={
            10: {"probes": 0, "libc": None, "reason": "process exited before its libc was seen"},
            20: {
                "probes": 29,
                "libc": "/x/libc.so.6",
                "reason": "libc /x/libc.so.6 was not mapped by any process when probes were attached",
                "arenas": 1,
                "heaps": 0,
                "lock_waits": {},
            },
        },
    )
    t = views.build(4, None, cur)
    assert (
        t.notes[0]
        == "PID 10 (alpha): glibc allocator internals are not available (process exited before its libc was seen)."
    )
    assert t.notes[1] == "PID 20 (beta): libc /x/libc.so.6 was not mapped by any process when probes were attached."
    assert [r[0] for r in t.rows] == [20]


def test_glibc_view_empty_says_so():
    t = views.build(4, None, {"time": 1.0, "processes": {}})
    assert t.rows == [] and t.notes
    assert "(no activity)" not in views.text_table(t)


@pytest.mark.parametrize(
    "n,expected",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (65536, "64.0 KiB"),
        (10 * 1024 * 1024, "10.0 MiB"),
        (3 * 1024**3, "3.00 GiB"),
        (200 * 1024**2, "200 MiB"),
        (-2048, "-2.00 KiB"),
        (100.4, "100 B"),
    ],
)
def test_human_bytes(n, expected):
    assert human_bytes(n) == expected


@pytest.mark.parametrize(
    "x,expected",
    [
        (0, "0"),
        (2.5, "2.5"),
        (7.0, "7"),
        (812, "812"),
        (12_345, "12.3k"),
        (4_500_000, "4.50M"),
        (999.6, "1000"),
    ],
)
def test_human_count(x, expected):
    assert human_count(x) == expected


def test_batch_text_and_json_keep_raw_numbers():
    t = views.build(1, PREV, CUR)
    text = views.text_table(t)
    assert text.splitlines()[0].startswith("== processes: 3 processes")
    assert "LOST faults=3" in text.splitlines()[0]
    assert "2.00 MiB" in text  # beta's live bytes, human-readable
    js = views.to_json(t)
    json.dumps(js)
    beta = [r for r in js["rows"] if r["pid"] == 20][0]
    assert beta["live_bytes"] == 2 << 20 and beta["malloc_per_s"] == 50.0
    assert js["sort"] == "malloc_per_s" and js["descending"] is True


def test_reused_pid_restarts_from_zero():
    prev = {"time": 0.0, "processes": {5: proc(5, "old", malloc=1000)}}
    cur = {"time": 1.0, "processes": {5: proc(5, "new", malloc=10)}}
    t = views.build(1, prev, cur)
    assert t.rows[0][2] == 10.0


def test_processes_without_per_call_data_are_blank_not_zero():
    # --always-on: only the fault source reports processes
    cur = {
        "time": 2.0,
        "start": 1.0,
        "processes": {7: {"pid": 7, "comm": "quiet", "faults_user": 4, "faults_kernel": 0}},
    }
    t = views.build(1, None, cur)
    row = dict(zip([c.key for c in t.columns], t.rows[0]))
    assert row["malloc_per_s"] is None and row["live_bytes"] is None and row["faults_per_s"] == 4.0
    cells = views.format_rows(t)[0]
    assert cells[2] == "" and cells[views.FAULTS_COLUMN] == "4"
    assert views.to_json(t)["rows"][0]["malloc_per_s"] is None
    assert t.columns[t.sort].key == "faults_per_s"
    assert "no per-call malloc data" in views.summary(t)


def test_unknown_view():
    with pytest.raises(ValueError):
        views.build(7, None, {})  # views 1-6 exist (5: call stacks, 6: heap efficiency)
    assert views.view_name("2") == "slab"
    assert views.view_name(5) == "stacks"
    assert views.view_name(6) == "heap"


def test_mean_size_is_per_interval_blank_when_idle():
    # PID 20 made calls before PREV and none since: no mean for this interval (docs: per interval)
    prev = {"time": 1.0, "processes": {20: proc(20, "idle", malloc=10, requested=1000)}}
    cur = {"time": 2.0, "processes": {20: proc(20, "idle", malloc=10, requested=1000)}}
    t = views.build(1, prev, cur)
    row = row_dict(t)[0]
    assert row["malloc_per_s"] == 0 and row["mean_size"] is None
    assert views.format_rows(t)[0][t.column_index("mean_size")] == ""
    assert views.to_json(t)["rows"][0]["mean_size"] is None
    # busy again: the mean of this interval only (10 calls of 1 MB), not since attach
    cur2 = {"time": 3.0, "processes": {20: proc(20, "idle", malloc=20, requested=1000 + 10 * 2**20)}}
    assert row_dict(views.build(1, cur, cur2))[0]["mean_size"] == 2**20


def test_process_with_another_allocator_says_so_instead_of_blank():
    p = {
        "pid": 40,
        "comm": "redis-server",
        "faults_user": 3,
        "faults_kernel": 0,
        "allocator": "jemalloc",
        "allocator_traced": False,
    }
    g = dict(proc(41, "plain", malloc=5, requested=50), allocator="glibc", allocator_traced=True)
    prev = {"time": 1.0, "processes": {}}
    cur = {"time": 2.0, "processes": {40: p, 41: g}}
    t = views.build(1, prev, cur)
    rows = {r["pid"]: r for r in row_dict(t)}
    assert rows[40]["untraced_allocator"] == "jemalloc" and rows[40]["malloc_per_s"] is None
    assert rows[41]["untraced_allocator"] is None and rows[41]["malloc_per_s"] == 5
    text = views.text_table(t)
    line = [ln for ln in text.splitlines() if "redis-server" in ln][0]
    assert "allocator: jemalloc (not traced)" in line
    assert "not traced" not in [ln for ln in text.splitlines() if " plain " in ln][0]
    assert (
        views.to_json(t)["rows"][[r["pid"] for r in views.to_json(t)["rows"]].index(40)]["untraced_allocator"]
        == "jemalloc"
    )


def test_glibc_view_system_wide_on_a_probeless_libc_explains():
    # system-wide on a libc without USDT probes: the glibc source attached nothing and
    # lists no process; the view says why, as it does per PID with -p
    libc_path = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    cur = {
        "time": 2.0,
        "processes": {},
        "glibc": {},
        "glibc_collector": {
            "libcs": [
                {
                    "libc": libc_path,
                    "probes": 0,
                    "sites": 0,
                    "attached": False,
                    "reason": f"libc {libc_path} has no USDT probes (Debian builds glibc without --enable-systemtap)",
                }
            ]
        },
    }
    t = views.build(4, {"time": 1.0}, cur)
    line = views.summary(t)
    assert "0 processes with probes, 0 without" not in line
    assert line.startswith("the libc in use has no malloc USDT probes"), line
    assert any(libc_path in n and "no malloc USDT probes" in n and "enable-systemtap" in n for n in t.notes), t.notes
    assert not any("No process is being watched" in n for n in t.notes)
    # with a libc that has probes attached, nothing changes
    cur["glibc_collector"]["libcs"][0].update(probes=29, sites=37, attached=True, reason=None)
    t = views.build(4, {"time": 1.0}, cur)
    assert "0 processes with probes" in views.summary(t)


def test_snapshot_notes_are_shown_in_every_view():
    cur = {
        "time": 2.0,
        "processes": {},
        "notes": ["skipped /tmp/x/libc.so.6 (mapped by PID 5): not a readable ELF file"],
    }
    for v in views.VIEWS:
        assert (
            "skipped /tmp/x/libc.so.6 (mapped by PID 5): not a readable ELF file"
            in views.build(v, {"time": 1.0}, cur).notes
        )
