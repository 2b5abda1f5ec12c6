"""A process named with -p keeps its row while it makes no malloc call (a sleeping process
here; memcached serving from its own slab allocator in the field): in the processes view with
zero rates, in heap efficiency with its real RSS, in every report."""

import json
import subprocess
import sys

import pytest
from support.cli import run_pymtrace

# 16 MiB touched before attach, then asleep: no malloc call while top watches
IDLE = """
import time
block = bytearray(16 << 20)
print("ready", flush=True)
time.sleep(600)
"""


def vm_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.bpf
def test_an_idle_watched_process_keeps_its_rows_with_rss():
    idle = subprocess.Popen([sys.executable, "-c", IDLE], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline() == "ready\n"
        args = ("top", "--json", "-p", idle.pid, "-i", "0.5", "-n", "2", "--view", "processes", "--view", "heap")
        out = run_pymtrace(*args, timeout=240, check=True).stdout
        rss = vm_rss(idle.pid)
        docs = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert len(docs) == 2
        for doc in docs:
            procs = {r["pid"]: r for r in doc["views"]["processes"]["rows"]}
            assert idle.pid in procs, doc["views"]["processes"]
            row = procs[idle.pid]
            assert row["malloc_per_s"] == 0 and row["free_per_s"] == 0 and row["live_bytes"] == 0
            heap = {r["pid"]: r for r in doc["views"]["heap"]["rows"]}
            assert idle.pid in heap, doc["views"]["heap"]
            assert rss * 0.8 <= heap[idle.pid]["rss_bytes"] <= rss * 1.2, (heap[idle.pid], rss)
            assert heap[idle.pid]["rss_bytes"] > 16 << 20
    finally:
        idle.kill()
        idle.wait()
