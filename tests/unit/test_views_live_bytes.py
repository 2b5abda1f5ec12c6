"""Live bytes as a user can act on them: never negative on screen (frees of blocks allocated
before attach are shown apart, as OLDER FREED), WASTED never negative, and no ANON/LIVE ratio
over too few live bytes to mean anything; --json keeps the raw numbers and adds fields."""

import json

import pytest

from pymtrace.sinks import views
from pymtrace.sources import heapefficiency

KIB, MIB = 1 << 10, 1 << 20


def proc(pid, comm, allocated, freed, growth, t):
    """A process entry at time T: ALLOCATED and FREED chunk bytes since attach, its anonymous
    RSS GROWTH since attach (on a 50 MiB base)."""
    return {
        "pid": pid,
        "comm": comm,
        "calls": {"malloc": 10 * t, "free": 20 * t},
        "requested_bytes": allocated,
        "allocated_bytes": allocated,
        "freed_bytes": freed,
        "live_bytes": allocated - freed,
        "rss_bytes": (80 * MIB) + growth,
        "rss_anon_bytes": (50 * MIB) + growth,
        "rss_anon_base_bytes": 50 * MIB,
    }


def snapshot(t):
    return {
        "time": t,
        "start": 0.0,
        "processes": {
            # a shell freeing blocks it allocated before attach: allocated - freed = -510 KiB
            10: proc(10, "bash", 100 * KIB, 610 * KIB, 2 * MIB, t),
            # 480 live bytes against 110 KiB of RSS growth: a ratio of 230x that means nothing
            11: proc(11, "tiny", 960, 480, 110 * KIB, t),
            # RSS shrank since attach while 10 MiB are live: nothing wasted, not -12 MiB
            12: proc(12, "shrunk", 20 * MIB, 10 * MIB, -2 * MIB, t),
            # an ordinary process: every number shown as it is
            13: proc(13, "big", 300 * MIB, 100 * MIB, 500 * MIB, t),
        },
    }


def cells(table, pid):
    """{column key: text shown} of PID's row."""
    i = table.column_index("pid")
    for row, shown in zip(table.rows, views.format_rows(table)):
        if row[i] == pid:
            return {c.key: s for c, s in zip(table.columns, shown)}
    raise AssertionError(f"no row for {pid}")


def json_row(table, pid):
    return next(r for r in json.loads(json.dumps(views.to_json(table)))["rows"] if r["pid"] == pid)


@pytest.mark.parametrize("view", ["processes", "heap"])
def test_no_negative_live_bytes_and_older_frees_shown_apart(view):
    table = views.build(view, snapshot(1.0), snapshot(2.0))
    text = views.text_table(table)
    bash = cells(table, 10)
    assert bash["live_bytes"] == "0 B"
    assert not any(c.startswith("-") for c in bash.values()), bash
    assert "510 KiB" in text  # the frees of older blocks, apart: a column or a note
    assert "older" in text.lower()
    assert "-510" not in text and " live" in views.summary(table) and "-" not in views.summary(table).split(" live")[0]
    raw = json_row(table, 10)
    assert raw["live_bytes"] == -510 * KIB  # JSON: the raw number, as before
    if view == "heap":
        assert bash["older_freed_bytes"] == "510 KiB" and raw["older_freed_bytes"] == 510 * KIB
        assert cells(table, 13)["older_freed_bytes"] == ""
        assert bash["wasted_bytes"] == "2.00 MiB"  # the growth: no live block accounts for it


@pytest.mark.parametrize("view", ["processes", "heap"])
def test_no_ratio_over_too_few_live_bytes(view):
    table = views.build(view, snapshot(1.0), snapshot(2.0))
    assert cells(table, 11)["rss_anon_per_live"] == ""  # 480 live bytes
    assert cells(table, 10)["rss_anon_per_live"] == ""  # no live bytes since attach
    assert cells(table, 13)["rss_anon_per_live"] == "2.50x"
    assert json_row(table, 11)["rss_anon_per_live"] == pytest.approx(110 * KIB / 480)  # raw in JSON
    assert heapefficiency.RATIO_MIN_LIVE_BYTES > 480


def test_wasted_never_negative():
    table = views.build("heap", snapshot(1.0), snapshot(2.0))
    assert cells(table, 12)["wasted_bytes"] == "0 B"
    assert json_row(table, 12)["wasted_bytes"] == -12 * MIB  # raw in JSON
    assert cells(table, 13)["wasted_bytes"] == "300 MiB"


def test_heap_sentences_say_no_ratio_over_few_live_bytes():
    snap = snapshot(1.0)
    tiny = heapefficiency.describe(11, "tiny", snap["processes"][11], None)
    assert "234" not in tiny and "x)" not in tiny and "too few live bytes for a ratio" in tiny, tiny
    bash = heapefficiency.describe(10, "bash", snap["processes"][10], None)
    assert "-" not in bash.split(":", 1)[1] and "freed 0.5 MiB of blocks allocated before attach" in bash, bash
