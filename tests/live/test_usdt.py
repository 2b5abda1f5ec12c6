"""pymtrace.sources.glibc.GlibcSource on real BPF (argument decoding: tests/unit/test_usdt_decoding.py)."""

import json
import os
import shutil
import subprocess
import time

import pytest
from support.cli import workload_facts
from support.uprobes import ProbeWatch

from pymtrace.sources import glibc
from pymtrace.tracee import launch, libc

# ------------------------------------------------------------------ unit: argument specs


# ------------------------------------------------------------------ BPF: the source


def _launch_traced(prefix, argv, env=None, watch=None):
    """Launch on the sdt libc stopped at exec, attach a streaming source, run to the end.
    WATCH (a ProbeWatch of this process) records the uprobes held while attached."""
    events = []
    L = launch.Launched(prefix + argv, env=env, stdout=subprocess.PIPE)
    c = glibc.GlibcSource(pids=[L.pid], libcs={L.pid: L.libc_path()}, on_event=events.append)
    try:
        c.attach()
        if watch:
            watch.wait_attached(29)
        L.resume()
        out, _ = L.proc.communicate(timeout=60)
        snap = c.snapshot()
    finally:
        c.close()
        L.kill()
    mine = [e for e in events if e.pid == L.pid]
    return L.pid, out.decode(), mine, snap


@pytest.mark.bpf
def test_source_sbrk_chain_and_aggregates_exact(sdt_libc, cbuild):
    prefix, path = sdt_libc
    watch = ProbeWatch(os.getpid())
    pid, out, events, snap = _launch_traced(prefix, [cbuild("glibc_sbrk"), "8", "200000"], watch=watch)
    f = workload_facts(out)
    start, grown, final = (int(f[k][0][0], 16) for k in ("start_brk", "grown_brk", "final_brk"))
    more = [e for e in events if e.probe == "memory_sbrk_more"]
    less = [e for e in events if e.probe == "memory_sbrk_less"]
    assert more and less
    assert more[0].args[0] == start
    for a, b in zip(more, more[1:]):
        assert a.args[0] + a.args[1] == b.args[0]  # brk + size = next brk
    assert more[-1].args[0] + more[-1].args[1] == grown
    assert sum(e.args[1] for e in more) == grown - start
    assert sum(e.args[1] for e in less) == grown - final
    assert less[-1].args[0] == final
    g = snap["glibc"][pid]
    assert g["probes"] >= 29 and g["reason"] is None and g["libc"] == path
    assert g["sbrk_bytes"] == grown - start and g["sbrk_grow_count"] == len(more)
    assert g["sbrk_trimmed_bytes"] == grown - final and g["sbrk_trim_count"] == len(less)
    assert g["mmap_threshold"] == 4 * 1024 * 1024 and g["trim_threshold"] == 65536
    assert g["params"]["top_pad"] == {"value": 0, "cause": "mallopt", "source": "probe"}
    assert g["events"] == len(events)
    assert snap["glibc_collector"]["lost_events"] == 0
    watch.assert_gone()


TUNABLES = {  # tunable: (value, probe, old value in glibc 2.36)
    "tcache_max": (512, "memory_tunable_tcache_max_bytes", 1032),
    "tcache_count": (3, "memory_tunable_tcache_count", 7),
    "tcache_unsorted_limit": (5, "memory_tunable_tcache_unsorted_limit", 0),
    "mmap_threshold": (262144, "memory_mallopt_mmap_threshold", 131072),
    "trim_threshold": (524288, "memory_mallopt_trim_threshold", 131072),
    "top_pad": (16384, "memory_mallopt_top_pad", 131072),
    "mmap_max": (4096, "memory_mallopt_mmap_max", 65536),
    "arena_max": (6, "memory_mallopt_arena_max", 0),
    "arena_test": (3, "memory_mallopt_arena_test", 8),
    "perturb": (0x5A, "memory_mallopt_perturb", 0),
    "mxfast": (96, "memory_mallopt_mxfast", 128),
}


@pytest.mark.bpf
def test_source_every_malloc_tunable(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(f"glibc.malloc.{k}={v[0]}" for k, v in TUNABLES.items())
    pid, out, events, snap = _launch_traced(prefix, [cbuild("glibc_params"), "idle"], env=env)
    by_probe = {e.probe: e for e in events}
    for name, (value, probe, old) in TUNABLES.items():
        e = by_probe.get(probe)
        assert e is not None, f"no {probe} event for tunable {name}"
        assert e.args[0] == value and e.args[1] == old, (name, e.args)
        assert e.cause == "tunable" and not e.unreadable
    params = snap["glibc"][pid]["params"]
    for name, (value, _, _) in TUNABLES.items():
        key = "tcache_max" if name == "tcache_max" else name
        assert params[key]["value"] == value and params[key]["cause"] == "tunable", name


@pytest.mark.bpf
def test_source_arenas_heaps(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    pid, out, events, snap = _launch_traced(prefix, [cbuild("glibc_arenas"), "new", "3"])
    f = workload_facts(out)
    creators = {int(t) for _, t in f["tid"]}
    reusers = {int(t) for _, t in f["reuse_tid"]}
    new = [e for e in events if e.probe == "memory_arena_new"]
    assert {e.tid for e in new} == creators and len(new) == 3
    heaps_new = [e for e in events if e.probe == "memory_heap_new"]
    heaps_free = [e for e in events if e.probe == "memory_heap_free"]
    assert len(heaps_new) == 4 and len(heaps_free) == 1  # thread 0 outgrew one 64 MiB heap
    free_list = [e for e in events if e.probe == "memory_arena_reuse_free_list"]
    assert {e.tid for e in free_list} == reusers
    assert {e.args[0] for e in free_list} == {e.args[0] for e in new}
    # heap sizes: replay the events, compare with the BPF per-heap map
    sizes = {}
    for e in events:
        if e.probe in ("memory_heap_new", "memory_heap_more", "memory_heap_less"):
            sizes[e.args[0]] = e.args[1]
        elif e.probe == "memory_heap_free":
            sizes.pop(e.args[0])
    assert any(e.probe == "memory_heap_more" for e in events)
    assert any(e.probe == "memory_heap_less" for e in events)
    g = snap["glibc"][pid]
    assert g["arenas"] == 4 and g["arenas_created"] == 3 and g["arena_reuse_free_list"] == 3
    assert g["heaps"] == 3 and g["heaps_created"] == 4 and g["heaps_freed"] == 1
    assert {int(h["heap"], 16): h["size"] for h in g["heap_list"]} == sizes
    assert g["heap_bytes"] == sum(sizes.values())
    arenas = {int(a["arena"], 16): a for a in g["arena_list"]}
    for e in new:
        assert arenas[e.args[0]]["creator_tid"] == e.tid and arenas[e.args[0]]["attaches"] == 2


@pytest.mark.bpf
def test_source_arena_lock_waits_per_thread(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    pid, out, events, snap = _launch_traced(prefix, [cbuild("glibc_arenas"), "wait", "2"])
    waiters = {int(t) for _, t in workload_facts(out)["wait_tid"]}
    waits = [e for e in events if e.probe == "memory_arena_reuse_wait"]
    assert {e.tid for e in waits} == waiters and len(waits) == 2
    for e in waits:
        assert e.args[0] == e.args[1]  # &arena->mutex is the arena's first member
    g = snap["glibc"][pid]
    assert g["lock_waits"] == {t: 1 for t in waiters}
    assert g["arena_lock_waits"] == 2
    arena = waits[0].args[1]
    assert {int(a["arena"], 16): a["waits"] for a in g["arena_list"]}[arena] == 2
    assert g["params"]["arena_max"]["value"] == 1 and g["params"]["arena_max"]["cause"] == "mallopt"


@pytest.mark.bpf
def test_source_system_wide_two_libcs(sdt_libc, cbuild, tmp_path):
    """Attach by library path to two different libc files at once (as with containers)."""
    prefix, path = sdt_libc
    if not prefix:
        pytest.skip("needs the loader-prefixed sdt libc to make a second copy")
    copy = tmp_path / "glibc2"
    copy.mkdir()
    for name in ("libc.so.6", "ld-linux-x86-64.so.2"):
        shutil.copy2(os.path.join(os.path.dirname(path), name), copy / name)
    prefix2 = [str(copy / "ld-linux-x86-64.so.2"), "--library-path", str(copy)]
    events = []
    c = glibc.GlibcSource(pids=None, libcs=[path, str(copy / "libc.so.6")], on_event=events.append)
    try:
        c.attach()
        attached = {i["libc"] for i in c.libc_info if i["attached"]}
        assert {path, str(copy / "libc.so.6")} <= attached
        prog = cbuild("glibc_params")
        p1 = subprocess.run(prefix + [prog, "mallopt"], capture_output=True, timeout=60)
        p2 = subprocess.run(prefix2 + [prog, "dyn"], capture_output=True, timeout=60)
        assert p1.returncode == 0 and p2.returncode == 0
        time.sleep(0.2)
        c.poll()
        snap = c.snapshot()
    finally:
        c.close()
    libc_of_site = {s.id: s.libc for s in c.sites}
    by_libc = {}
    for e in events:
        by_libc.setdefault(libc_of_site[e.site], []).append(e)
    mallopts = [e for e in by_libc.get(path, []) if e.probe == "memory_mallopt"]
    dyn = [e for e in by_libc.get(str(copy / "libc.so.6"), []) if e.probe == "memory_mallopt_free_dyn_thresholds"]
    assert len(mallopts) >= 10 and len(dyn) >= 2
    pids = {e.pid for e in mallopts} | {e.pid for e in dyn}
    assert all(snap["glibc"][p]["events"] > 0 for p in pids)


@pytest.mark.bpf
def test_source_snapshot_only_for_top(sdt_libc, cbuild):
    """top's use: no stream, snapshots while the process runs; the glibc view renders it;
    a process on a probe-less libc gets a reason; forget() drops an exited process."""
    from pymtrace.sinks import views

    prefix, path = sdt_libc
    work = subprocess.Popen(
        prefix + [cbuild("glibc_idle"), "4", "100000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    plain = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 10  # until its loader has mapped libc (a fresh exec has not)
    while libc.process_libc(plain.pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    c = glibc.GlibcSource(pids=[work.pid, plain.pid])
    watch = ProbeWatch(os.getpid())
    try:
        assert work.stdout.readline().startswith("ready")
        c.attach()
        watch.wait_attached(29)
        assert not c.stream
        before = c.snapshot()["glibc"][work.pid]  # alive: parameters read from its memory
        assert before["mmap_threshold"] == 1 << 20 and before["trim_threshold"] == 64 << 20
        assert before["params"]["mmap_threshold"] == {"value": 1 << 20, "cause": "initial", "source": "memory"}
        work.stdin.write("go\n")
        work.stdin.flush()
        facts = dict(ln.split() for ln in work.stdout.read().splitlines())
        work.wait(timeout=30)
        snap = c.snapshot()
        g = snap["glibc"][work.pid]
        assert g["sbrk_bytes"] == int(facts["after_brk"], 16) - int(facts["before_brk"], 16)
        assert g["params"]["top_pad"]["value"] == 0 and g["params"]["top_pad"]["cause"] == "mallopt"
        assert g["alive"] is False and g["mmap_threshold"] is None  # set before attach, gone now
        assert g["arenas"] == 1 and g["heaps"] == 0 and g["lock_waits"] == {}
        assert snap["glibc_collector"]["lost_events"] == 0
        p = snap["glibc"][plain.pid]
        system = libc.system_libc()
        if not libc.malloc_probes(system):
            assert p["probes"] == 0 and p["reason"].startswith(f"libc {system} has no USDT probes")
        table = views.build("glibc", None, json.loads(json.dumps(snap)))
        assert any(row[0] == work.pid and row[6] == g["sbrk_bytes"] for row in table.rows)
        c.exited(work.pid)  # as top's process-exit watcher calls it
        last = c.snapshot()["glibc"][work.pid]  # reported once more, final values
        assert last["alive"] is False and last["sbrk_bytes"] == g["sbrk_bytes"]
        assert work.pid not in c.snapshot()["glibc"]  # then forgotten, maps included
        assert all(k.pid != work.pid for k in c.bpf["threads"].keys())
        assert c.bpf["stats"].get(__import__("ctypes").c_uint32(work.pid)) is None
    finally:
        c.close()
        work.kill()
        plain.kill()
        plain.wait()
    watch.assert_gone()


@pytest.mark.bpf
def test_source_counts_every_lost_event(sdt_libc, cbuild):
    """A 1-page ring buffer nobody drains during the run: events received + lost events
    counted in BPF = probe hits counted in the BPF aggregate (nothing vanishes silently)."""
    prefix, _ = sdt_libc
    events = []
    L = launch.Launched(prefix + [cbuild("glibc_arenas"), "new", "3"], stdout=subprocess.DEVNULL)
    c = glibc.GlibcSource(pids=[L.pid], libcs={L.pid: L.libc_path()}, on_event=events.append, ringbuf_pages=1)
    try:
        c.attach()
        L.resume()
        L.proc.wait(timeout=60)  # no poll() meanwhile
        snap = c.snapshot()
    finally:
        c.close()
        L.kill()
    lost = snap["glibc_collector"]["lost_events"]
    assert lost > 0
    assert len([e for e in events if e.pid == L.pid]) + lost == snap["glibc"][L.pid]["events"]
