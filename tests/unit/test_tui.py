"""The full-screen UI driven in tmux (send-keys, capture-pane) on a fake snapshot source; the
real `pymtrace top` in tmux (BPF) is tests/live/test_tui_bpf.py.

Run as a script, this file is the tiny test entry point: the real pymtrace.sinks.tui.run() on a
fake snapshot source with known rates, so the order of rows under each sort is known.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

if __name__ == "__main__":  # run as the UI entry point: tests/ on the path for support
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from support.tui import assert_clean_shell, rows, selected_row, wait_order  # noqa: E402

HERE = os.path.abspath(__file__)


# pid, comm, malloc/s, calloc/s, live bytes
FAKE = [
    (101, "aaa-malloc", 900, 1, 1 << 10),
    (102, "bbb-calloc", 100, 500, 1 << 30),
    (103, "ccc-idle", 10, 50, 1 << 20),
]


# call sites of pid 101 in view 5: function, bytes/s, calls/s, frames from the root
FAKE_SITES = [
    ("hot_site", 8000, 100, ("_start", "main", "hot_caller", "hot_site", "malloc")),
    ("cold_site", 300, 3, ("_start", "main", "cold_caller", "cold_site", "malloc")),
]


def fake_stacks(el):
    """snapshot["stacks"] (collect.snapshot.StackProcess) growing at the FAKE_SITES rates."""
    sites = {}
    for i, (name, b, c, frames) in enumerate(FAKE_SITES):
        values = {"alloc_objects": c * el, "alloc_bytes": b * el, "inuse_objects": 1.0, "inuse_bytes": 64.0}
        stack = {"id": i + 1, **values, "samples": 5, "complete": True}
        stack["frames"] = [{"function": f, "module": "prog", "file": "", "line": 0, "inlined": False} for f in frames]
        sites[f"/prog+0x{i:x}"] = {"function": name, "module": "prog", "offset": i, **values, "samples": 5}
        sites[f"/prog+0x{i:x}"]["stacks"] = [stack]
    return {
        101: {
            "pid": 101,
            "comm": "aaa-malloc",
            "sample_bytes": 524288,
            "samples": 10,
            "complete_samples": 10,
            "stacks_kept": 2,
            "max_stacks": 500,
            "overflow_samples": 0,
            "sites": sites,
        }
    }


class FakeSource:
    """Cumulative counters growing at the FAKE rates, like the real sources' snapshots."""

    def __init__(self, fail_after=None):
        self.t0 = time.monotonic() - 1.0
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("fake source failed on purpose")
        now = time.monotonic()
        el = now - self.t0
        procs = {}
        for pid, comm, m, c, live in FAKE:
            procs[pid] = {
                "pid": pid,
                "comm": comm,
                "calls": {
                    "malloc": int(m * el),
                    "calloc": int(c * el),
                    "realloc": 0,
                    "free": int(m * el),
                    "free_null": 0,
                    "memalign": 0,
                    "posix_memalign": 0,
                    "valloc": 0,
                    "pvalloc": 0,
                },
                "requested_bytes": int((m + c) * el * 64),
                "allocated_bytes": 0,
                "freed_bytes": 0,
                "live_bytes": live,
                "failed": 0,
                "size_log2": [],
                "faults_user": int(pid * el),
                "faults_kernel": 0,
            }
        return {
            "time": now,
            "processes": procs,
            "slab": {
                "filp": {"allocs": int(300 * el), "frees": int(290 * el), "bytes_alloc": int(76800 * el)},
                "kmalloc-64": {"allocs": int(40 * el), "frees": int(40 * el), "bytes_alloc": int(2560 * el)},
            },
            "fault_regions": {101: {"[heap]": int(60 * el), "anon": int(41 * el)}},
            "glibc": {
                101: {
                    "arenas": 2,
                    "heaps": 1,
                    "heap_bytes": 135168,
                    "sbrk_bytes": 1 << 20,
                    "mmap_threshold": 131072,
                    "trim_threshold": 262144,
                    "lock_waits": {"105": 3},
                },
                102: {"probes": 0, "libc": "/usr/lib/x86_64-linux-gnu/libc.so.6"},
            },
            "stacks": fake_stacks(el),
        }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-i", "--interval", type=float, default=0.5)
    ap.add_argument("--fail-after", type=int)
    ap.add_argument("--pidfile")
    args = ap.parse_args()
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(str(os.getpid()))
    from pymtrace.sinks import tui

    return tui.run(FakeSource(args.fail_after), interval=args.interval)


def start_fake(t, *extra):
    before = t.stty("before")
    t.type(" ".join([sys.executable, HERE, "-i", "0.3", *extra]))
    return before


def test_fake_source_views_sort_pause_quit(tmux):
    t = tmux
    before = start_fake(t)
    s = wait_order(t, ["aaa-malloc", "bbb-calloc", "ccc-idle"], "processes view sorted by MALLOC/s")
    assert t.alternate_on()
    assert "[1 processes]" in s and "sort MALLOC/s desc" in s
    head = [ln for ln in s.splitlines() if "PID" in ln and "COMM" in ln][0]
    for col in ("MALLOC/s", "CALLOC/s", "REALLOC/s", "FREE/s", "MEMALIGN/s", "REQ", "MEAN", "LIVE", "FAULTS/s"):
        assert col in head
    assert "3 processes" in s and "q quit" in s

    # right: sort by CALLOC/s, biggest first
    t.send("Right")
    s = wait_order(t, ["bbb-calloc", "ccc-idle", "aaa-malloc"], "sorted by CALLOC/s")
    assert "sort CALLOC/s desc" in s
    # r: reverse
    t.send("r")
    wait_order(t, ["aaa-malloc", "ccc-idle", "bbb-calloc"], "reversed")
    # '<' back to MALLOC/s (descending again)
    t.send("<")
    wait_order(t, ["aaa-malloc", "bbb-calloc", "ccc-idle"], "sorted by MALLOC/s again")
    # '>' ... to LIVE (column 11, after NEW/s and DELETE/s): bbb has 1 GiB live
    for _ in range(9):
        t.send(">")
    s = wait_order(t, ["bbb-calloc", "ccc-idle", "aaa-malloc"], "sorted by LIVE")
    assert "sort LIVE desc" in s and "1.00 GiB" in s

    # views: 2 slab, 3 faults, 4 glibc, Tab cycles back to 1
    t.send("2")
    s = t.wait_for(lambda s: "[2 slab caches]" in s and "CACHE" in s, "slab view")
    assert [r[0] for r in rows(s, "CACHE")] == ["filp", "kmalloc-64"]
    t.send("3")
    s = t.wait_for(lambda s: "[3 page faults]" in s and "REGION" in s, "faults view")
    assert "[heap]" in s and "(all)" in s
    t.send("4")
    s = t.wait_for(lambda s: "[4 glibc internals]" in s and "ARENAS" in s, "glibc view")
    assert "MMAP" in s and "128 KiB" in s
    assert "PID 102 (bbb-calloc)" in s and "no malloc USDT probes" in s
    # 5 call stacks: the hottest site first and selected; Down selects the next, Enter shows
    # its stack root to leaf, Enter again the rows
    t.send("Tab")
    s = t.wait_for(lambda s: "[5 call stacks]" in s and "CALL SITE" in s, "stacks view")
    assert [r[2] for r in rows(s, "PID")] == ["hot_site", "cold_site"]
    assert selected_row(t, "PID")[2] == "hot_site"
    t.send("Down")
    t.wait_for(lambda s: (selected_row(t, "PID") or [""] * 3)[2] == "cold_site", "the next site selected")
    t.send("Enter")
    s = t.wait_for(lambda s: "stack 1:" in s, "the selected site's stack")
    body = s[s.index("cold_site in prog") :]
    assert [line.strip() for line in body.splitlines()[2:7]] == [
        "_start (prog)",
        "main (prog)",
        "cold_caller (prog)",
        "cold_site (prog)",
        "malloc (prog)",
    ]
    t.send("Enter")
    t.wait_for(lambda s: "CALL SITE" in s and "hot_site" in s, "back to the rows")
    t.send("Tab")
    t.wait_for(lambda s: "[6 heap efficiency]" in s and "ANON/LIVE" in s, "heap efficiency view")
    t.send("Tab")
    s = t.wait_for(lambda s: "[1 processes]" in s, "Tab back to processes")
    assert "sort LIVE desc" in s  # each view keeps its sort

    # pause: the screen stops changing; space resumes
    t.send("p")
    s1 = t.wait_for(lambda s: "PAUSED" in s, "paused")
    time.sleep(1.0)
    assert t.screen() == s1
    t.send("Space")
    t.wait_for(lambda s: "PAUSED" not in s, "resumed")

    t.send("q")
    assert_clean_shell(t, before)


def test_first_screen_waits_for_one_interval(tmux):
    """No rates until one interval after the first snapshot: the first screen says so, the
    rows come one interval later."""
    t = tmux
    before = t.stty("before")
    t.type(" ".join([sys.executable, HERE, "-i", "3"]))
    s = t.wait_for(lambda s: "pymtrace top" in s, "UI up")
    assert "measuring the first 3s interval" in s and "aaa-malloc" not in s
    wait_order(t, ["aaa-malloc", "bbb-calloc", "ccc-idle"], "rows after one interval")
    t.send("q")
    assert_clean_shell(t, before)


def test_sigterm_restores_terminal(tmux, tmp_path):
    pidfile = tmp_path / "ui.pid"
    before = start_fake(tmux, "--pidfile", str(pidfile))
    tmux.wait_for(lambda s: "[1 processes]" in s, "UI up")
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    assert_clean_shell(tmux, before)


def test_exception_restores_terminal(tmux):
    before = start_fake(tmux, "--fail-after", "4")
    s = tmux.wait_for(lambda s: "fake source failed on purpose" in s, "traceback after the UI")
    assert "RuntimeError" in s
    assert_clean_shell(tmux, before)


def test_no_terminal_is_a_clear_error():
    proc = subprocess.run([sys.executable, HERE], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode != 0
    assert "the full-screen view needs a terminal; use --batch or --json" in proc.stderr
    assert "\x1b[" not in proc.stdout  # no escape sequences written to the pipe


def test_long_region_paths_keep_their_file_name():
    from pymtrace.sinks import tui, views

    path = "/usr/lib/x86_64-linux-gnu/" + "very-long-directory-name/" * 3 + "libexample.so.1"
    cur = {
        "time": 2.0,
        "start": 1.0,
        "processes": {1: {"comm": "x", "faults_user": 5}},
        "fault_regions": {1: {path: 5}},
    }
    head, lines = tui.layout(views.build(3, None, cur), 200)
    assert lines[1].split()[0].startswith("~") and "libexample.so.1" in lines[1]


def test_state_keys_without_terminal():
    """The key handling itself, no curses screen needed."""
    import curses

    from pymtrace.sinks import tui

    src = FakeSource()
    st = tui.State(interval=1.0)
    st.push(src())
    time.sleep(0.05)
    st.push(src())
    assert st.table().view == "processes"
    st.key(ord("\t"))
    assert st.table().view == "slab"
    st.key(curses.KEY_BTAB)
    st.key(curses.KEY_BTAB)
    assert st.table().view == "heap"  # the last view
    st.key(curses.KEY_BTAB)
    assert st.table().view == "stacks"
    st.key(curses.KEY_BTAB)
    assert st.table().view == "glibc"
    st.key(ord("1"))
    st.key(curses.KEY_LEFT)  # from MALLOC/s to COMM: names sort A-Z
    t = st.table()
    assert t.columns[t.sort].key == "comm" and not t.reverse
    st.key(curses.KEY_LEFT)
    st.key(curses.KEY_LEFT)  # wraps around to the last column (NOTE: names A-Z)
    t = st.table()
    assert t.columns[t.sort].key == "untraced_allocator" and not t.reverse
    st.key(curses.KEY_LEFT)
    t = st.table()
    assert t.columns[t.sort].key == "faults_per_s" and t.reverse
    assert st.key(ord("x")) is False
    st.key(ord("q"))
    assert st.quit


def _sites_snapshot(t, alloc_bytes):
    """A snapshot at time T whose PID 101 has the call sites ALLOC_BYTES names (function ->
    cumulative bytes), each with one stack; the sites' keys are stable across snapshots."""
    snap = {"time": t, "processes": {}, "stacks": fake_stacks(1.0)}
    sites = snap["stacks"][101]["sites"]
    by_name = {site["function"]: key for key, site in sites.items()}
    for name in set(by_name) - set(alloc_bytes):
        del sites[by_name[name]]
    for name, b in alloc_bytes.items():
        sites[by_name[name]]["alloc_bytes"] = sites[by_name[name]]["stacks"][0]["alloc_bytes"] = b
    return snap


def test_selection_follows_its_site_when_the_rows_re_sort():
    """Like htop: the selected call site stays selected (and its stacks shown) when another
    site overtakes it; it went by position, so Enter after a re-sort showed another site."""
    import curses

    from pymtrace.sinks import tui

    st = tui.State(interval=1.0, view=tui.STACKS_VIEW)
    st.push(_sites_snapshot(0.0, {"hot_site": 0, "cold_site": 0}))
    st.push(_sites_snapshot(1.0, {"hot_site": 8000, "cold_site": 300}))
    t = st.table()
    assert [r[2] for r in t.rows] == ["hot_site", "cold_site"] and st.select(t) == 0
    st.key(curses.KEY_DOWN)
    assert st.select(st.table()) == 1 and st.selected_key == (101, "/prog+0x1")
    st.push(_sites_snapshot(2.0, {"hot_site": 8100, "cold_site": 90000}))  # cold overtakes hot
    t = st.table()
    assert [r[2] for r in t.rows] == ["cold_site", "hot_site"]
    assert t.rows[st.select(t)][2] == "cold_site"
    st.key(ord("\n"))
    assert tui.views.detail_lines(t, t.rows[st.select(t)])[0].startswith("cold_site in prog (PID 101)")
    st.key(ord("\n"))
    st.key(ord("r"))  # another order: still the same site
    t = st.table()
    assert [r[2] for r in t.rows] == ["hot_site", "cold_site"] and st.select(t) == 1
    st.key(curses.KEY_UP)  # Up from it: the row above it on the screen
    assert t.rows[st.select(st.table())][2] == "hot_site"
    st.push(_sites_snapshot(3.0, {"cold_site": 90000}))  # its site is gone: the row at its place
    t = st.table()
    assert st.select(t) == 0 and st.selected_key == (101, "/prog+0x1")
    st.key(ord("6"))  # another view starts at its first row
    assert st.selected == 0 and st.selected_key is None


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    raise SystemExit(main())
