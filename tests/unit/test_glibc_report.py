"""The end-of-run report of `pymtrace run` / `summary` without BPF: Report from synthetic events,
AddressMap, the help text (the CLI on real BPF: tests/live/test_summary.py)."""

from support.cli import run_pymtrace

from pymtrace.sinks.run_report import render_text
from pymtrace.sources.glibc_report import Report


class Ev:
    def __init__(self, probe, args, tid=100, ts=0, cause=None, flags=0, fd=0, path=None):
        self.pid, self.tid, self.comm, self.probe, self.args = 100, tid, "w", probe, tuple(args)
        self.ts, self.cause, self.flags, self.unreadable, self.fd, self.path = ts, cause, flags, frozenset(), fd, path


def test_report_from_synthetic_events():
    r = Report(100)
    r.add(Ev("memory_sbrk_more", [0x1000, 0x2000]))
    r.add(Ev("memory_sbrk_more", [0x3000, 0x1000]))
    r.add(Ev("memory_sbrk_less", [0x3000, 0x1000]))
    r.add(Ev("memory_mallopt_mmap_threshold", [4096, 131072, 0], cause="mallopt"))
    r.add(Ev("memory_mallopt_free_dyn_thresholds", [200704, 401408]))
    r.add(Ev("memory_heap_new", [0x7F0000000000, 135168], tid=101))
    r.add(Ev("memory_arena_new", [0x7F0000000030, 640], tid=101))
    r.add(Ev("memory_heap_more", [0x7F0000000000, 200000], tid=101))
    r.add(Ev("memory_arena_reuse_wait", [0x5000, 0x5000, 0], tid=102))
    r.add(Ev("memory_malloc_retry", [1 << 31]))
    r.add(Ev("open", [3], path="/lib/x.so"))
    r.add(Ev("mmap", [0x9000000, 0x4000, (1 << 32) | 2], flags=16, fd=3))
    r.add(Ev("mmap", [0xA000000, 0x40000, (3 << 32) | 0x22]))
    r.add(Ev("brk", [0x1000]))
    r.add(Ev("brk", [0x4000]))
    for addr in (0x1000, 0x2FFF, 0x7F0000001000, 0x9001000, 0xA000000, 0xA001000, 0x12345):
        r.add(Ev("page_fault", [addr, 0, 6]))
    res = r.result()
    assert res["sbrk"] == {
        "grown_bytes": 0x3000,
        "grow_count": 2,
        "trimmed_bytes": 0x1000,
        "trim_count": 1,
        "failed": 0,
        "chain_breaks": 0,
        "net_bytes": 0x2000,
    }
    assert [(t["param"], t["old"], t["new"], t["cause"]) for t in res["thresholds"]] == [
        ("mmap_threshold", 131072, 4096, "mallopt"),
        ("mmap_threshold", 4096, 200704, "dynamic"),
        ("trim_threshold", None, 401408, "dynamic"),
    ]
    assert res["heaps"][0]["initial_size"] == 135168 and res["heaps"][0]["final_size"] == 200000
    assert res["arena_lock_waits"] == [{"tid": 102, "waits": 1, "arenas": ["0x5000"]}]
    assert res["retries"]["malloc"] == {"count": 1, "bytes": 1 << 31}
    assert res["faults"]["regions"]["[heap]"] == 2
    assert res["faults"]["regions"]["arena heaps"] == 1
    assert res["faults"]["regions"]["files"] == 1 and res["faults"]["files"] == {"/lib/x.so": 1}
    assert res["faults"]["regions"]["mmapped chunks"] == 2
    assert res["faults"]["regions"]["unknown"] == 1
    doc = {
        "pid": 100,
        "comm": "w",
        "libc": "/x/libc.so.6",
        "probes": 29,
        "reason": None,
        "duration_s": 1.0,
        "exit_code": 0,
        "lost_events": 0,
        "glibc": dict(res),
        "faults": res["faults"],
    }
    text = render_text(doc)
    assert "Arena lock waits per thread" in text and "dynamic" in text and "/lib/x.so" in text


def test_arena_reservation_recognised_with_or_without_noreserve():
    """glibc's new_heap() reserves 2 * HEAP_MAX_SIZE PROT_NONE and trims it to one aligned
    HEAP_MAX_SIZE: glibc 2.36 with MAP_NORESERVE (0x4022), Debian 13's 2.41 without (0x22,
    seen in a 6.12 guest's mmap trace). Either is an arena heap; a writable 128 MiB anonymous
    mapping and a PROT_NONE one of another size stay mmapped chunks."""
    heap = 64 << 20
    for flags, region in ((0x4022, "arena heaps"), (0x22, "arena heaps")):
        r = Report(100)
        r.add(Ev("mmap", [0x7F0003800000, 2 * heap, flags]))  # prot 0 in the high half
        r.add(Ev("munmap", [0x7F0003800000, 0x800000]))
        r.add(Ev("munmap", [0x7F0008000000, heap - 0x800000]))
        r.add(Ev("page_fault", [0x7F0004000000 + 0x1000, 0, 6]))
        assert r.result()["faults"]["regions"][region] == 1, hex(flags)
    for length, prot in ((2 * heap, 3), (heap // 2, 0)):
        r = Report(100)
        r.add(Ev("mmap", [0x7F0004000000, length, (prot << 32) | 0x22]))
        r.add(Ev("page_fault", [0x7F0004000000 + 0x1000, 0, 6]))
        assert r.result()["faults"]["regions"]["mmapped chunks"] == 1, (length, prot)


def test_run_help_has_examples_and_overhead():
    for cmd in ("run", "summary"):
        proc = run_pymtrace(cmd, "--help")
        assert proc.returncode == 0 and "OVERHEAD" in proc.stdout and "examples:" in proc.stdout


def test_address_map_replaces_overlaps():
    from pymtrace.sources.glibc_report import AddressMap

    m = AddressMap()
    m.set(0x1000, 0x5000, "a")
    m.set(0x2000, 0x3000, "b")  # punches a hole: a, b, a
    assert [m.get(x)[2] for x in (0x1000, 0x2000, 0x2FFF, 0x3000, 0x4FFF)] == ["a", "b", "b", "a", "a"]
    assert m.get(0x5000) is None and m.get(0xFFF) is None
    m.remove(0x2800, 0x4000)
    assert m.get(0x2900) is None and m.get(0x27FF)[2] == "b" and m.get(0x4000)[2] == "a"
    m.set(0x0, 0x10000, "c")  # covers everything
    assert m.starts == [0] and m.get(0x4000)[2] == "c"
    for i in range(1000):  # many short-lived mappings stay cheap: one live interval each
        m.set(0x100000 + i * 0x1000, 0x101000 + i * 0x1000, "x")
        m.remove(0x100000 + i * 0x1000, 0x101000 + i * 0x1000)
    assert len(m.starts) == 1
