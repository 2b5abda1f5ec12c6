"""A process that starts and exits between two snapshots keeps its name: the BPF programs
record the comm when they create the process's entry and again at exec (a forked child
faults, and may malloc, under its parent's name before it execs). Without that, /proc is
all top has, and a process gone before the snapshot would show as "?" ("unknown" in the
exporter)."""

import subprocess
import time

import pytest
from support.top import Top


def _first_doc_with(top, pid, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = top.json_doc(timeout=max(1, deadline - time.monotonic()))
        p = doc["snapshot"]["processes"].get(str(pid))
        if p is not None:
            return doc, p
    raise AssertionError(f"process {pid} never appeared in top's snapshots")


@pytest.mark.bpf
def test_short_lived_process_shows_under_its_own_comm(cbuild):
    exe = cbuild("top_shortlived")
    top = Top("--json", "-i", "0.5", "--no-glibc")  # system-wide: the child is not known in advance
    try:
        top.json_doc(timeout=180)  # attached
        top.probes_attached(3)
        for _attempt in range(5):
            child = subprocess.Popen([exe])
            assert child.wait(timeout=30) == 0
            doc, p = _first_doc_with(top, child.pid)
            if not p["exited"]:
                continue  # a snapshot caught it alive (its name came from /proc): again
            assert p["comm"] == "top_shortlived", p
            assert p["calls"]["malloc"] >= 10 and p["calls"]["free"] >= 10, p
            assert p["faults_user"] >= 256, p
            views = doc["views"]
            rows = [r for r in views["processes"]["rows"] if r.get("pid") == child.pid]
            assert rows and rows[0]["comm"] == "top_shortlived", rows
            break
        else:
            pytest.fail("every run of the child was caught alive by a snapshot")
        assert top.stop() == 0
        top.watch.assert_gone()
    finally:
        top.kill()
