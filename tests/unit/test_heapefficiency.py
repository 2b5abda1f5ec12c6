"""Heap efficiency without BPF: the flag's rule (pymtrace.sources.heapefficiency), the view
built from a snapshot, and the RSS source against the kernel's /proc/PID/status."""

import os

from pymtrace.sinks import views
from pymtrace.sources import heapefficiency
from pymtrace.tracee import proc

MiB = 1 << 20


def _entry(live, anon, base=0, **more):
    return {"pid": 7, "comm": "app", "live_bytes": live, "rss_anon_bytes": anon, "rss_anon_base_bytes": base, **more}


def test_flag_needs_both_the_ratio_and_the_absolute_waste():
    assert heapefficiency.assess(_entry(100 * MiB, 200 * MiB))["heap_flag"] is True
    assert heapefficiency.assess(_entry(100 * MiB, 140 * MiB))["heap_flag"] is False  # 1.4x
    assert heapefficiency.assess(_entry(10 * MiB, 60 * MiB))["heap_flag"] is False  # 6x but 50 MiB
    a = heapefficiency.assess(_entry(100 * MiB, 300 * MiB, base=100 * MiB))  # growth since attach
    assert a["anon_growth_bytes"] == 200 * MiB and a["rss_anon_per_live"] == 2.0 and a["heap_flag"] is True
    none = heapefficiency.assess({"pid": 7, "rss_anon_bytes": MiB, "rss_anon_base_bytes": 0})
    assert none["heap_flag"] is None and none["rss_anon_per_live"] is None  # no live bytes to judge


def test_heap_view_rows_flag_line_and_glibc_totals():
    frag = _entry(100 * MiB, 200 * MiB, rss_bytes=210 * MiB)
    ok = dict(_entry(100 * MiB, 101 * MiB, rss_bytes=110 * MiB), pid=8, comm="ok")
    snap = {
        "time": 2.0,
        "start": 1.0,
        "processes": {"7": frag, "8": ok, "9": {"pid": 9, "comm": "gone"}},
        "glibc": {"7": {"probes": 37, "sbrk_bytes": 190 * MiB, "heap_bytes": 0, "heaps": 0, "arenas": 1}},
    }
    t = views.build("heap", None, snap)
    rows = [views.to_json(t)["rows"][i] for i in range(2)]
    assert [r["pid"] for r in rows] == [7, 8]  # by WASTED, biggest first; 9 has no RSS: not listed
    assert rows[0]["flag"] == "FRAGMENTED?" and rows[0]["glibc_heap_bytes"] == 190 * MiB
    assert rows[1]["flag"] == "" and rows[1]["glibc_heap_bytes"] is None
    line = t.notes[0]
    assert line.startswith("PID 7 (app): anon RSS grew 200.0 MiB for 100.0 MiB live (2.00x)")
    assert "main arena grew 190.0 MiB by sbrk" in line and "malloc_trim" in line
    assert "2.00x" in views.text_table(t)


def test_rss_is_the_kernels_rss_anon():
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    rss, anon = proc.rss(os.getpid())
    assert abs(anon - status("RssAnon:")) <= 256 * 1024 and abs(rss - status("VmRSS:")) <= 256 * 1024
    assert proc.rss(2**22 + 1) is None  # no such process


def test_full_screen_heap_view_shows_the_selected_process_line():
    from pymtrace.sinks import tui

    frag = _entry(100 * MiB, 200 * MiB, rss_bytes=210 * MiB)
    ok = dict(_entry(100 * MiB, 101 * MiB, rss_bytes=110 * MiB), pid=8, comm="ok")
    t = views.build("heap", None, {"time": 2.0, "start": 1.0, "processes": {7: frag, 8: ok}})
    assert views.to_json(t)["rows"][1]["line"].startswith("PID 8 (ok): anon RSS grew 101.0 MiB")
    first = tui.heap_notes(t, 0)
    assert first[0].startswith("PID 7 (app)") and "malloc_trim" in first[0] and first[-1] == views.HEAP_NOTE
    second = tui.heap_notes(t, 1)  # the flagged line of the other row is not repeated
    assert second[0].startswith("PID 8 (ok)") and "not flagged" in second[0] and len(second) == 2
