"""`pymtrace top --stacks` (view 5) on a real process whose call chains and per-round calls the
test knows (workloads/heap_chains.c -l, -O2 -fomit-frame-pointer, one chain through a shared
library): the call sites, their rates against each other and against top's own counters,
in-use bytes of the leaking and the freeing chains, and the full stacks root to leaf."""

import json
import subprocess

import pytest
from support import heapchains
from support.cli import run_pymtrace
from support.schema import problems

from pymtrace.bpf import load as bpfload

pytestmark = pytest.mark.bpf

# call site -> (module, calls per round, (smallest, largest) block, chain above the site)
SITES = {
    "leaf_alloc": ("heap_chains", 200, (100, 107), ["main", "alpha", "beta", "leaf_alloc"]),
    "lib_inner": ("libheapchain.so", 10, (4000, 4000), ["main", "gamma_", "lib_outer", "lib_inner"]),
    "young_leaf": ("heap_chains", 3, (3000, 3000), ["main", "delta", "young_leaf"]),
    # above worker: libc's start_thread (a name only with libc's debug info)
    "thread_leaf": ("heap_chains", 50, (2500, 2549), ["worker", "thread_leaf"]),
}
ROUND_MS = 20
MALLOC = ("malloc", "__libc_malloc")


@pytest.fixture(scope="module")
def exe(build_dir):
    return heapchains.build(build_dir)


def test_top_stacks_json_sites_rates_inuse_and_chains(exe):
    # rounds enough for a slow (emulated) machine's start-up; killed at the end
    target = subprocess.Popen([exe, "-l", str(ROUND_MS), "100000"], stdout=subprocess.PIPE)
    try:
        assert target.stdout.readline() == b"ready\n"
        proc = run_pymtrace(
            "top", "--stacks", "--stack-sample-bytes", "1", "-p", str(target.pid), "--json", "-n", "2",
            "--view", "stacks", "--view", "processes",
            timeout=600,  # an emulated VM (Debian 12's, TCG): ~3.5 min, mostly compiling
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert target.poll() is None  # still running, untraced now
    finally:
        target.kill()
        target.wait()
    assert bpfload.own_uprobe_events() == []
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["iteration"] for d in docs] == [1, 2]
    doc = docs[-1]
    assert problems(doc["snapshot"], json_keys=True) == []
    dt = doc["views"]["stacks"]["interval"]
    rows = {r["site"]: r for r in doc["views"]["stacks"]["rows"]}
    assert set(SITES) <= set(rows), rows.keys()
    rounds = rows["lib_inner"]["allocs_per_s"] * dt / 10  # rounds in the interval, by one site
    assert 3 <= rounds <= dt * 1000 / ROUND_MS + 1
    for name, (module, per_round, (low, high), chain) in SITES.items():
        row = rows[name]
        assert row["pid"] == target.pid and row["module"] == module
        # every call sampled (weight 1): each site's calls are whole rounds of its own, and an
        # interval cuts at most one round between two sites
        assert abs(row["allocs_per_s"] * dt / per_round - rounds) <= 1.01, (name, row)
        mean = row["alloc_bytes_per_s"] / row["allocs_per_s"]
        assert low - 1e-6 <= mean <= high + 1e-6, (name, mean)
        assert row["alloc_bytes"] >= row["alloc_bytes_per_s"] * dt
        for stack in row["stacks"]:
            functions = [f["function"] for f in stack["frames"]]
            assert stack["complete"] and functions[-1] in MALLOC, functions
            assert functions[-1 - len(chain) : -1] == chain, functions
            root = functions[0]  # libc's clone3 is named only with libc's debug info
            assert root in ("_start", "__clone3", "clone3", "clone") or root.startswith("libc.so.6+0x"), functions
    # freed at once: at most the one block between its malloc and free; leaked: everything
    assert rows["leaf_alloc"]["inuse_bytes"] <= 107 and rows["thread_leaf"]["inuse_bytes"] <= 2549
    leaked = rows["lib_inner"]
    assert leaked["inuse_bytes"] % 4000 == 0 and leaked["alloc_bytes"] - leaked["inuse_bytes"] <= 40000
    assert leaked["inuse_bytes"] >= leaked["alloc_bytes_per_s"] * dt
    # the same calls through top's own counters (the same interval): malloc calls/s agree
    (process,) = doc["views"]["processes"]["rows"]
    sampled = sum(r["allocs_per_s"] for r in rows.values())
    assert abs(sampled - process["malloc_per_s"]) <= 0.05 * process["malloc_per_s"], (sampled, process)
