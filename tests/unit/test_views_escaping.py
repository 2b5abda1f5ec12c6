"""Names a process chooses (its comm, the paths it maps, its symbols) reach a terminal only
escaped: in every view of `top` (--batch text, the full screen's drawing), heap's text
report, `probes` lines and the `run`/`summary` report. JSON keeps them raw (json.dumps
escapes them itself). The real process with such a name: tests/live/test_top_hostile_name.py."""

import argparse
import json
import time

import pytest
from support.cli import run_pymtrace
from support.heapprofile import LIBC, FakeSymbolizer

from pymtrace.sinks import tui, views
from pymtrace.sinks.batch import Reporter
from pymtrace.sinks.heap_text import render_text as heap_text
from pymtrace.sinks.probe_lines import hit_line
from pymtrace.sinks.run_report import render_text as run_text
from pymtrace.sources.glibc import ProbeHit
from pymtrace.sources.heapprofile import HeapProfile
from pymtrace.tracee.unwind import Frame, Module

# clears the screen, sets the window title, rings the bell: a name prctl(PR_SET_NAME) can set
HOSTILE = "\x1b[2J\x1b]0;PWN\x07X"
ESCAPED = "\\x1b[2J\\x1b]0;PWN\\x07X"
HOSTILE_PATH = "/tmp/\x1b[31mred\x9b1m\u202egnp.so"  # C1 CSI and a bidi override too
ESCAPED_PATH = "/tmp/\\x1b[31mred\\x9b1m\\u202egnp.so"
FILE_NAME = "\x1b[2Jgone.out"  # a file that does not exist


def unprintable(text):
    """The characters of TEXT a terminal acts on (newlines and tabs of the layout aside)."""
    return sorted({c for c in text if not c.isprintable() and c not in "\n\t"})


def test_printable_escapes_what_a_terminal_acts_on_and_nothing_else():
    from pymtrace.sinks.text import printable

    assert printable(HOSTILE) == ESCAPED
    assert printable(HOSTILE_PATH) == ESCAPED_PATH
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"
    assert printable("a\nb", keep="\n") == "a\nb"
    assert printable("python3 é 名前 /usr/lib/libc.so.6 (deleted)") == "python3 é 名前 /usr/lib/libc.so.6 (deleted)"
    assert printable("\x7f\x00") == "\\x7f\\x00"


def hostile_snapshot(t):
    """A snapshot at time T whose every process-chosen name is hostile."""
    frame = {"function": HOSTILE, "module": HOSTILE_PATH, "file": HOSTILE_PATH, "line": 3, "inlined": False}
    values = {"alloc_objects": 10 * t, "alloc_bytes": 1000 * t, "inuse_objects": 1.0, "inuse_bytes": 64.0}
    site = {"function": HOSTILE, "module": HOSTILE_PATH, "offset": 1, **values, "samples": 5}
    site["stacks"] = [{"id": 1, **values, "samples": 5, "complete": True, "frames": [frame]}]
    return {
        "time": t,
        "start": 0.0,
        "processes": {
            7: {
                "pid": 7,
                "comm": HOSTILE,
                "calls": {"malloc": 100 * t, "free": 90 * t},
                "requested_bytes": 1000 * t,
                "allocated_bytes": 2000 * t,
                "freed_bytes": 1000 * t,
                "live_bytes": 1000 * t,
                "faults_user": 5 * t,
                "rss_bytes": 200 << 20,
                "rss_anon_bytes": 190 << 20,
                "rss_anon_base_bytes": 0,
            },
            8: {"pid": 8, "comm": HOSTILE, "allocator": HOSTILE_PATH, "allocator_traced": False},
        },
        "fault_regions": {7: {HOSTILE_PATH: 5 * t}},
        "slab": {HOSTILE: {"allocs": 10 * t, "frees": t, "bytes_alloc": 100 * t, "bytes_req": 90 * t}},
        "glibc": {
            7: {"pid": 7, "comm": HOSTILE, "libc": HOSTILE_PATH, "probes": 0, "reason": f"libc {HOSTILE_PATH} odd"},
            9: {"pid": 9, "comm": HOSTILE, "libc": "/lib/libc.so.6", "probes": 29, "reason": HOSTILE},
        },
        "stacks": {
            7: {
                "pid": 7,
                "comm": HOSTILE,
                "sample_bytes": 1,
                "samples": 10,
                "complete_samples": 10,
                "stacks_kept": 1,
                "max_stacks": 500,
                "overflow_samples": 1,
                "sites": {"x": site},
            }
        },
        "errors": {"slab": HOSTILE},
        "notes": [f"libc {HOSTILE_PATH} left out"],
    }


@pytest.mark.parametrize("view", views.VIEWS)
def test_every_view_prints_names_escaped_and_keeps_them_raw_in_json(view):
    table = views.build(view, hostile_snapshot(1.0), hostile_snapshot(2.0))
    text = views.text_table(table)
    assert unprintable(text) == [], text
    assert ESCAPED in text or ESCAPED_PATH in text, text
    # JSON: the raw name, which json.dumps writes as \u001b..., never a raw ESC
    doc = json.dumps(views.to_json(table))
    assert unprintable(doc) == [] and ("\\u001b[2J" in doc or "\\u001b[31m" in doc)
    assert any(HOSTILE in v or HOSTILE_PATH in v for v in strings(json.loads(doc)["rows"]))


def strings(obj):
    """Every string in the JSON value OBJ."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def test_stack_detail_lines_escape_frames():
    table = views.build("stacks", hostile_snapshot(1.0), hostile_snapshot(2.0))
    lines = views.detail_lines(table, table.rows[0])
    assert unprintable("\n".join(lines)) == [] and any(ESCAPED in line for line in lines)


def test_batch_report_totals_and_errors_escape_names(capsys):
    args = argparse.Namespace(interval=1.0, json=False, limit=0)
    Reporter(args, ["processes", "totals", "faults", "heap"], []).report(hostile_snapshot(1.0), hostile_snapshot(2.0))
    out = capsys.readouterr().out
    assert unprintable(out) == [], out
    assert ESCAPED in out and f"note: slab: {ESCAPED}" in out
    args.json = True
    Reporter(args, ["processes", "totals"], []).report(hostile_snapshot(1.0), hostile_snapshot(2.0))
    doc = capsys.readouterr().out
    assert unprintable(doc) == []
    assert json.loads(doc)["views"]["totals"]["rows"][0]["comm"] == HOSTILE  # raw in JSON


class Screen:
    """A curses window that records what is drawn (the full screen's draw() calls only these)."""

    def __init__(self, height=40, width=200):
        self.size = (height, width)
        self.text = []

    def getmaxyx(self):
        return self.size

    def erase(self):
        self.text = []

    def refresh(self):
        pass

    def addnstr(self, y, x, text, n, attr=0):
        self.text.append(text[:n])


@pytest.mark.parametrize("view", range(len(views.VIEWS)))
def test_full_screen_draws_names_escaped(view, monkeypatch):
    monkeypatch.setattr(tui.curses, "A_BOLD", 1, raising=False)
    monkeypatch.setattr(tui.curses, "A_REVERSE", 2, raising=False)
    monkeypatch.setattr(tui.curses, "A_STANDOUT", 4, raising=False)
    state = tui.State(view=view)
    state.push(hostile_snapshot(1.0))
    state.push(hostile_snapshot(2.0))
    scr = Screen()
    tui.draw(scr, state, state.table())
    drawn = "\n".join(scr.text)
    assert unprintable(drawn) == [], drawn
    if view == tui.STACKS_VIEW:  # Enter: the selected site's stacks, frames escaped
        state.key(ord("\n"))
        tui.draw(scr, state, state.table())
        assert unprintable("\n".join(scr.text)) == [] and ESCAPED in "\n".join(scr.text)


def test_heap_text_report_escapes_symbols_and_paths():
    evil = Module(HOSTILE_PATH, "")
    frames = {(LIBC, 0x100): [Frame("malloc", "malloc.c", 3287)], (evil, 0x10): [Frame(HOSTILE, HOSTILE_PATH, 7)]}
    profile = HeapProfile(1, {"command": HOSTILE, "pids": [7], "exe": HOSTILE_PATH})
    profile.add(1, ((LIBC, 0x100), (evil, 0x10)), 4000, 10**9, True)
    profile.finish({1}, 2 * 10**9)
    text = heap_text(profile, FakeSymbolizer(frames))
    assert unprintable(text) == [], text
    assert f"\t\t{ESCAPED} [" in text


def test_probes_line_escapes_the_comm():
    hit = ProbeHit()
    hit.ts, hit.pid, hit.tid, hit.comm, hit.probe = 10**9, 7, 7, HOSTILE, "memory_sbrk_more"
    hit.names, hit.args, hit.unreadable, hit.cause = ("addr", "size"), (0x1000, 4096), frozenset(), None
    line = hit_line(hit, time.time(), as_json=False)
    assert unprintable(line) == [] and ESCAPED in line
    assert unprintable(hit_line(hit, 0.0, as_json=True)) == []


def test_run_report_escapes_comm_command_libc_and_files():
    doc = {
        "pid": 7,
        "comm": HOSTILE,
        "command": [HOSTILE_PATH, "-x"],
        "libc": HOSTILE_PATH,
        "probes": 0,
        "reason": f"libc {HOSTILE_PATH} has no USDT probes",
        "duration_s": 1.0,
        "exit_code": 0,
        "faults": {
            "total": 3,
            "bytes_faulted_in_approx": 3 << 12,
            "regions": {"files": 3},
            "files": {HOSTILE_PATH: 3},
        },
    }
    text = run_text(doc)
    assert unprintable(text) == [], text
    assert f"({ESCAPED})" in text and ESCAPED_PATH in text


def test_errors_reach_the_terminal_escaped(tmp_path):
    """Every `pymtrace: error:` line goes through printable (errors name processes' files)."""
    run = run_pymtrace("dump", tmp_path / FILE_NAME)
    assert run.returncode != 0 and "pymtrace: error:" in run.stderr, run.stderr
    assert unprintable(run.stderr) == [] and "\\x1b[2J" in run.stderr, run.stderr


def test_analyze_text_escapes_names_read_from_binaries():
    """analyze's callers and stacks name functions and files read from the binaries a process
    mapped: shown escaped, like every other name from a process."""
    from pymtrace.sinks.analysis_text import caller_text
    from pymtrace.trace.report import Caller

    c = Caller(
        caller="0x401000",
        calls=3,
        allocations=3,
        requested_bytes=300,
        frees=0,
        never_freed=3,
        never_freed_bytes=300,
        function=HOSTILE,
        source=HOSTILE_PATH + ":7",
    )
    text = caller_text(c)
    assert unprintable(text) == []
    assert text == f"0x401000 {ESCAPED} ({ESCAPED_PATH}:7)"
