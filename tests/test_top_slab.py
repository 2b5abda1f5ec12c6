"""Slab view of `pymtrace top`: a workload creating N POSIX message queues shows N
allocations (and, after RCU, N frees) in the mqueue_inode_cache row. Slab counts are
system-wide (slab frees often run in RCU callbacks, not in the allocating process), so the
test allows a little activity from others on this rarely used cache."""
import time

import pytest

from test_top_support import Top, Workload, alive

N = 500
CACHE = "mqueue_inode_cache"


@pytest.mark.bpf
def test_known_slab_cache_row(cbuild):
    w = Workload([cbuild("top_slab"), str(N)])
    top = Top("--json", "-i", "0.5", "--always-on", "--no-glibc", "--view", "slab")
    try:
        top.json_doc()  # attached (system-wide)
        w.go()
        assert w.result()["queues"] == N
        deadline = time.monotonic() + 20
        while True:
            doc = top.json_after(time.monotonic())
            s = doc["snapshot"]["slab"].get(CACHE, {})
            if s.get("allocs", 0) >= N and s.get("frees", 0) >= N or time.monotonic() > deadline:
                break
        assert N <= s["allocs"] <= N + 20, s
        assert N <= s["frees"] <= N + 20, s  # inodes are freed after an RCU grace period
        assert s["bytes_alloc"] >= N * 64
        rows = [r for r in doc["views"]["slab"]["rows"] if r["cache"] == CACHE]
        assert rows and rows[0]["net_objects"] == s["allocs"] - s["frees"]
        assert top.stop() == 0
        assert alive(w.pid)
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()
