"""`pymtrace heap --sample-bytes 1` counts every call: checked against ground truth (the
workload's own count; for the sqlite3 CLI, `pymtrace record`'s exact trace of the same
deterministic script; in-process and through uprobes), with the ring buffer and the live-block
map sized by their options, and a run that loses samples says so in its last line, -q or not."""

import json
import re
import shutil

import pytest
from support import heapchains
from support.cli import run_pymtrace

pytestmark = pytest.mark.bpf

ALLOCATING = ("malloc", "calloc", "realloc", "memalign", "posix_memalign", "valloc", "pvalloc", "aligned_alloc")


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    return heapchains.build(tmp_path_factory.mktemp("chains"))


def folded_total(path, pattern=".*"):
    """Sum of the values of the folded stacks matching PATTERN."""
    total = 0
    for line in open(path, encoding="utf-8"):
        stack, value = line.rstrip("\n").rsplit(" ", 1)
        if re.fullmatch(pattern, stack):
            total += int(value)
    return total


def heap(out, *args, cmd):
    proc = run_pymtrace("heap", "-q", "--sample-bytes", "1", "--value", "alloc_objects", "-o", out, *args, "--", *cmd)
    assert "Traceback" not in proc.stderr
    return proc


def test_storm_exact(chains, tmp_path):
    """200,000 mallocs in a burst, every one counted, at the default ring size."""
    out = tmp_path / "storm.folded"
    proc = heap(out, cmd=(chains, "0", "200000", "64"))
    assert proc.returncode == 0, proc.stderr
    assert folded_total(out, rf"{heapchains.ROOT};storm_leaf;{heapchains.MALLOC}") == 200000
    for pattern, calls, _ in heapchains.CHAINS.values():
        assert folded_total(out, pattern) == calls


def test_small_ring_drops_reported_with_quiet(chains, tmp_path):
    """A ring too small for the burst, through uprobes (BPF cannot make the program wait): the
    lost samples are counted, and -q still prints them in the last line with the option that
    keeps them."""
    out = tmp_path / "storm.folded"
    proc = heap(out, "--ring-bytes", "64K", "--via", "uprobes", cmd=(chains, "0", "100000", "64"))
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"pymtrace heap: lost: ringbuf (\d+) \(.*--ring-bytes.*\); exit status 3", last)
    assert m, proc.stderr
    kept = folded_total(out, rf"{heapchains.ROOT};storm_leaf;{heapchains.MALLOC}")
    assert 0 < int(m.group(1)) and kept + int(m.group(1)) >= 100000 > kept


def test_live_map_sized_by_option(chains, tmp_path):
    """The chains leak 13 blocks: a live-block map of 4 loses the frees of the others' (counted,
    named in the last line); one of the default size holds them all."""
    out = tmp_path / "live.folded"
    proc = heap(out, "--max-live", "4", "--value", "inuse_objects", cmd=(chains, "0"))
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"pymtrace heap: lost: live_full (\d+) \(.*--max-live.*\); exit status 3", last)
    assert m and int(m.group(1)) >= 9, proc.stderr
    out = tmp_path / "live-default.folded"
    proc = heap(out, "--value", "inuse_objects", cmd=(chains, "0"))
    assert proc.returncode == 0, proc.stderr
    assert folded_total(out, heapchains.CHAINS["gamma"][0]) == 10
    assert folded_total(out, heapchains.CHAINS["delta"][0]) == 3


def test_ring_option_checked(tmp_path):
    for size in ("3000", "1000K", "8G"):
        proc = run_pymtrace("heap", "--ring-bytes", size, "-o", tmp_path / "x", "--", "true")
        assert proc.returncode == 1 and "--ring-bytes must be a power of two" in proc.stderr
    proc = run_pymtrace("heap", "--max-live", "0", "-o", tmp_path / "x", "--", "true")
    assert proc.returncode == 1 and "--max-live must be from 1" in proc.stderr


def test_sqlite_exact(tmp_path):
    """sqlite3 running 10,000 INSERTs (70,000-230,000 mallocs, stacks of every depth: unwinding is
    slower than the calls): heap's count of every allocating call equals the exact trace
    `pymtrace record` takes of the same deterministic script. Through uprobes the ring holds
    the backlog (1 GiB, ~4.6 KiB a sample: BPF cannot make the program wait); in-process the
    program waits for room in the default ring."""
    sqlite = shutil.which("sqlite3")
    if sqlite is None:
        pytest.skip("sqlite3 is not installed (apt-get install sqlite3)")
    script = tmp_path / "ins.sql"
    lines = ["CREATE TABLE t(a INTEGER, b TEXT);"]
    lines += [f"INSERT INTO t VALUES({i}, 'row {i} {i * 7919 % 100003}');" for i in range(10000)]
    script.write_text("\n".join(lines + ["SELECT count(*) FROM t;"]) + "\n")
    cmd = (sqlite, ":memory:", f".read {script}")
    trace = tmp_path / "sq.bin"
    run_pymtrace("record", "-o", trace, "--", *cmd, check=True, timeout=300)
    stats = json.loads(run_pymtrace("dump", "--json", "--stats", trace, check=True).stdout)["stats"]
    truth = sum(t["count"] for name, t in stats["types"].items() if name in ALLOCATING)
    assert truth > 50000  # (sqlite3 3.40: ~230,000; 3.46 allocates less: ~70,000)
    out = tmp_path / "sq.folded"
    args = ("-q", "--sample-bytes", "1", "--ring-bytes", "1G", "--value", "alloc_objects", "-o", out)
    proc = run_pymtrace("heap", *args, "--via", "uprobes", "--", *cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert folded_total(out) == truth
    # in-process (its default ring): sqlite3 runs faster than pymtrace unwinds, so its probes
    # wait for room in the ring rather than be lost
    fast = tmp_path / "fast.folded"
    proc = run_pymtrace("heap", *args[1:3], *args[5:-1], fast, "--", *cmd, timeout=300)
    assert proc.returncode == 0 and "drops: none" in proc.stderr, proc.stderr
    assert folded_total(fast) == truth
