"""The real `pymtrace top` (BPF) in tmux; the UI on a fake source is tests/unit/test_tui.py."""

import subprocess
import sys

import pytest
from support import heapchains
from support.machine import slowness
from support.paths import ROOT
from support.tui import assert_clean_shell, comms, rows, selected_row
from support.uprobes import ProbeWatch

LOW_RATE_WORKLOAD = """
import time
keep = []
while True:
    keep = [bytearray(100000) for _ in range(5)]   # > pymalloc's limit: real malloc/free calls
    time.sleep(0.1)
"""


@pytest.mark.bpf
def test_real_top_on_real_workloads(tmux, tmp_path):
    """The real `pymtrace top` (BPF) in tmux on the demo plus a slow python3 allocator."""
    t = tmux
    slow = subprocess.Popen(["/usr/bin/python3", "-c", LOW_RATE_WORKLOAD])
    pidfile = tmp_path / "top.pid"
    try:
        before = t.stty("before")
        root = ROOT
        t.type(
            f"cd {root} && sh -c 'echo $$ > {pidfile}; exec {sys.executable} -m pymtrace top --demo "
            f"-p {slow.pid} -i 0.5'"
        )
        # compiling and attaching takes a few seconds on a busy machine
        s = t.wait_for(
            lambda s: (
                "[1 processes]" in s
                and "pymtrace-demo" in s
                and "python3" in s
                and comms(s)
                and comms(s)[0] == "pymtrace-demo"
            ),
            "real top with both processes",
            timeout=120,
            fail_on="pymtrace: error",
        )
        top_pid = int(pidfile.read_text())
        watch = ProbeWatch(top_pid)
        watch.wait_attached(3)  # its uprobes, while it runs
        demo_row = [r for r in rows(s, "PID") if r[1] == "pymtrace-demo"][0]
        assert demo_row[2] not in ("0", "0.0")  # MALLOC/s of the demo
        # r: ascending MALLOC/s puts the slow python3 first
        t.send("r")
        t.wait_for(lambda s: comms(s) == ["python3", "pymtrace-demo"], "reversed order")
        # slab view: system-wide caches; sorting by name really reorders the rows
        t.send("2")
        s = t.wait_for(lambda s: "[2 slab caches]" in s and len(rows(s, "CACHE")) >= 3, "slab view")
        t.send("<")  # from ALLOCS/s to CACHE, A-Z

        # the header changes first: a capture can catch the rows mid-redraw, so wait for a
        # whole screen in name order (a sort that never happens still times out); names sort
        # regardless of case (the Debian VMs' kernels list PING and TCP among their caches)
        def cache_names(s):
            return [r[0] for r in rows(s, "CACHE") if r]

        def in_name_order(names):
            return names == sorted(names, key=str.lower)

        s = t.wait_for(
            lambda s: "sort CACHE asc" in s and len(cache_names(s)) >= 3 and in_name_order(cache_names(s)),
            "slab sorted by name",
        )
        assert in_name_order(cache_names(s))
        t.send("3")
        s = t.wait_for(lambda s: "[3 page faults]" in s and "REGION" in s and "(all)" in s, "faults view")
        t.send("4")
        s = t.wait_for(lambda s: "[4 glibc internals]" in s, "glibc view")
        from pymtrace.tracee import libc

        if not libc.malloc_probes(libc.system_libc()):
            t.wait_for(lambda s: "no malloc USDT probes" in s, "glibc view says the probes are missing")
        t.send("p")
        t.wait_for(lambda s: "PAUSED" in s, "paused")
        t.send("q")
        assert_clean_shell(t, before)
        watch.assert_gone()
        assert slow.poll() is None, "the traced process must keep running"
    finally:
        slow.kill()
        slow.wait()


@pytest.mark.bpf
def test_real_top_stacks_view_selects_a_site_and_shows_its_stack(tmux, tmp_path, build_dir):
    """`top --stacks -p PID` opens on view 5 with the workload's call sites; Enter on the
    selected (hottest) row shows its stack down to malloc; q leaves no probe behind."""
    t = tmux
    # 3,000 rounds of 20 ms: a minute here; where the CPU is emulated top takes about that
    # long to start, so the workload runs slowness() times longer (it is killed at the end)
    rounds = int(3000 * slowness())
    target = subprocess.Popen([heapchains.build(build_dir), "-l", "20", str(rounds)], stdout=subprocess.PIPE)
    pidfile = tmp_path / "top.pid"
    try:
        assert target.stdout.readline() == b"ready\n"
        before = t.stty("before")
        t.type(
            f"cd {ROOT} && sh -c 'echo $$ > {pidfile}; exec {sys.executable} -m pymtrace top --stacks "
            f"-p {target.pid} -i 0.5'"
        )
        s = t.wait_for(
            lambda s: "[5 call stacks]" in s and all(f in s for f in ("thread_leaf", "leaf_alloc", "lib_inner")),
            "the call sites",
            timeout=120,
            fail_on="pymtrace: error",
        )
        watch = ProbeWatch(int(pidfile.read_text()))
        watch.wait_attached(3)
        # the selection follows its site when the rows re-sort (rates change), so the row
        # drawn selected is the one Enter shows, wherever it has moved
        selected = selected_row(t, "PID")[2]
        t.send("Enter")
        s = t.wait_for(lambda s: "stack 1:" in s and "malloc" in s, "the selected site's stack")
        assert f"{selected} (heap_chains" in s or f"{selected} (libheapchain.so" in s
        t.send("Enter")
        t.wait_for(lambda s: "CALL SITE" in s, "back to the rows")
        t.send("q")
        assert_clean_shell(t, before)
        watch.assert_gone()
        assert target.poll() is None, "the traced process must keep running"
    finally:
        target.kill()
        target.wait()
