""".wl reader (Python) and the native simulator's input validation: corrupt, truncated and
hostile workloads give one clear error line, never a crash or a hang; both are fuzzed and must
agree on what is valid. (The guard under a memory cgroup, which needs root: tests/live/test_wl_bpf.py.)"""

import json
import os
import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.machine import slowness
from support.replay import UPSTREAM, one_thread, op  # UPSTREAM: the reference vector as upstream wrote it

from pymtrace.errors import CorruptFile
from pymtrace.trace.formats import wl

TIMEOUT = 20


# the simulator under AddressSanitizer + UndefinedBehaviorSanitizer: every fuzzed and hostile
# file also goes through it; any report exits with these codes (leaks are not checked: the
# simulator leaves its blocks to exit())
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:exitcode=99:abort_on_error=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=98",
}


@pytest.fixture(scope="session")
def asan_sim(tmp_path_factory):
    from pymtrace.replay import runner as replay

    exe = tmp_path_factory.mktemp("asan") / "pymtrace-replay-asan"
    subprocess.run(
        [
            "gcc",
            *replay.CFLAGS,
            "-O1",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-o",
            str(exe),
            replay.NATIVE_SRC,
        ],
        check=True,
    )
    return str(exe)


def run_asan(asan_sim, path, *extra, timeout=TIMEOUT):
    """Run the sanitized simulator; fail on any sanitizer report."""
    proc = subprocess.run(
        [asan_sim, *extra, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **SANITIZER_ENV),
    )
    assert proc.returncode not in (98, 99) and "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert proc.returncode >= 0, f"sanitized simulator killed by signal {-proc.returncode}"
    return proc


def run_sim(sim, tmp_path, data, *extra, name="w.wl"):
    path = tmp_path / name
    path.write_bytes(data)
    return subprocess.run([sim, *extra, str(path)], capture_output=True, text=True, timeout=TIMEOUT)


HOSTILE = {
    "bad opcode": (one_thread(op(wl.MALLOC, 1, 8) + b"\x2a"), "unknown opcode 42"),
    "header opcode in a stream": (one_thread(op(wl.NTHREADS, 3)), "not allowed in a thread stream"),
    "stream opcode in the header": (op(wl.ALLOC_PTRS, 4) + op(wl.MALLOC, 1, 2) + b"\x01", "not allowed in the header"),
    "index out of range": (one_thread(op(wl.FREE, 8)), "pointer index 8 out of range"),
    "realloc old index out of range": (one_thread(op(wl.REALLOC, 1, 99, 8)), "pointer index 99 out of range"),
    "sync id out of range": (one_thread(op(wl.SYNC_W, 5)), "sync id 5 out of range"),
    "sync never written": (one_thread(op(wl.SYNC_R, 3)), "deadlock: thread 0 waits at byte"),
    "sync cycle": (
        wl.build(4, 4, [op(wl.SYNC_R, 1) + op(wl.SYNC_W, 2) + b"\x01", op(wl.SYNC_R, 2) + op(wl.SYNC_W, 1) + b"\x01"]),
        "deadlock",
    ),
    "truncated varint": (one_thread(b"")[:-1] + bytes((wl.MALLOC, 1, 0x85)), "truncated"),
    "no DONE": (one_thread(op(wl.MALLOC, 1, 8))[:-1], "truncated"),
    "header without DONE": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1), "header has no DONE"),
    "no ALLOC_PTRS": (op(wl.NTHREADS, 0) + b"\x01", "no ALLOC_PTRS"),
    "offset beyond the file": (
        op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 999) + b"\x01",
        "outside the file body",
    ),
    "offset inside the header": (
        op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 0) + b"\x01\x01",
        "outside the file body",
    ),
    "NTHREADS mismatch": (
        op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 2) + op(wl.START_THREAD, 7) + b"\x01\x01",
        "NTHREADS says 2",
    ),
    "varint over 64 bits": (one_thread(bytes((wl.MALLOC, 1)) + b"\xff" * 10 + b"\x01"), "exceeds 64 bits"),
    "absurd alignment": (one_thread(op(wl.MEMALIGN, 1, 1 << 50, 8)), "alignment"),
    "too many threads": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1 << 30) + b"\x01", "threads"),
    "empty file": (b"", ""),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_workloads(case, sim, asan_sim, tmp_path):
    data, message = HOSTILE[case]
    if data:
        with pytest.raises(CorruptFile) as exc:
            wl.parse(data)
        assert message in str(exc.value)
    for extra in ([], ["--check"], ["--sync", "mutex"]):
        proc = run_sim(sim, tmp_path, data, *extra)
        assert proc.returncode in (2, 3), (case, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pymtrace-replay: ") and message in lines[0], lines
        assert proc.stdout == ""
        assert run_asan(asan_sim, tmp_path / "w.wl", *extra).returncode == proc.returncode


def test_huge_tables_rejected_cleanly(sim, tmp_path):
    data = (
        op(wl.ALLOC_PTRS, 1 << 39) + op(wl.ALLOC_SYNCS, 1 << 39) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 0) + b"\x01"
    )
    data = wl.build(1 << 39, 1 << 39, [op(wl.MALLOC, (1 << 39) - 1, 16) + b"\x01"])
    proc = run_sim(sim, tmp_path, data, "--no-fill")
    # either it replays (the tables are reserved lazily) or it says it cannot: never a crash
    assert proc.returncode in (0, 4), proc.stderr
    assert proc.returncode == 0 or "cannot reserve memory" in proc.stderr


def test_size_beyond_memory_rejected(sim, tmp_path):
    proc = run_sim(sim, tmp_path, one_thread(op(wl.MALLOC, 1, 1 << 62)))
    assert proc.returncode == 2 and "exceeds this machine's memory" in proc.stderr
    # a NULL result (index 0) of any size is skipped, not rejected
    proc = run_sim(sim, tmp_path, one_thread(op(wl.MALLOC, 0, 1 << 62)), "--json", "-")
    assert proc.returncode == 0, proc.stderr


def test_racing_threads_on_one_slot_do_not_double_free(sim, asan_sim, tmp_path):
    """Hostile but valid-looking: two unsynchronised threads free the same slot many times."""
    body = op(wl.MALLOC, 1, 64) + op(wl.FREE, 1)
    data = wl.build(4, 1, [body * 2000 + b"\x01", op(wl.FREE, 1) * 4000 + b"\x01"])
    proc = run_sim(sim, tmp_path, data)
    assert proc.returncode == 0, proc.stderr
    run_asan(asan_sim, tmp_path / "w.wl")


def test_racing_threads_never_take_a_block_with_another_size(sim, asan_sim, tmp_path):
    """Unsynchronised threads reusing one slot with different sizes (this passes validation):
    a slot's size and pointer are taken together, so take() never returns one thread's 16-byte
    block with another's 8 KiB size (whose 0x22 fill would overflow the heap: SIGSEGV, or ASan's
    heap-buffer-overflow in wmem). The race needs an unlucky interleaving; a simulator that
    tore the pair would be caught about every other run of this file on a busy 2-CPU machine
    (ASan: the overflow; the plain build: the overwritten block's size leaking into the live
    bytes), so eight runs miss it rarely."""
    small = (op(wl.MALLOC, 1, 16) + op(wl.FREE, 1)) * 20000 + b"\x01"
    big = (op(wl.MALLOC, 1, 8192) + op(wl.FREE, 1)) * 5000 + b"\x01"
    path = tmp_path / "race.wl"
    path.write_bytes(wl.build(2, 1, [small, big] * 6))
    for _ in range(4):
        # 60 s here; the emulated VMs' CPU (slowness() ~14) overran it once under load
        assert run_asan(asan_sim, path, timeout=60 * slowness()).returncode == 0
    # every stream ends by freeing the slot, so nothing stays live; a torn size/pointer pair
    # would leak the overwritten block's size into the live bytes
    for _ in range(4):
        proc = subprocess.run([sim, "--json", "-", str(path)], capture_output=True, text=True, timeout=60 * slowness())
        assert proc.returncode == 0, proc.stderr
        r = json.loads(proc.stdout)
        assert r["ideal_rss_end_bytes"] == 0, r["slot_overwrites"]


def test_overwritten_slot_leaves_the_live_bytes(sim, tmp_path):
    """An allocation into a slot still holding a block frees that block (untimed): its bytes
    leave the live bytes, so neither the ideal RSS nor the memory guard counts them."""
    data = one_thread(op(wl.MALLOC, 1, 1000) + op(wl.MALLOC, 1, 100) + op(wl.FREE, 1) + op(wl.MALLOC, 2, 10))
    proc = run_sim(sim, tmp_path, data, "--json", "-")
    r = json.loads(proc.stdout)
    assert r["slot_overwrites"] == 1
    assert r["ideal_rss_peak_bytes"] == 1100 and r["ideal_rss_end_bytes"] == 10  # both were live at once


def test_upstream_sized_sync_ids_accepted(sim, tmp_path):
    assert wl.parse(UPSTREAM).upstream_sync_sizing
    proc = run_sim(sim, tmp_path, UPSTREAM, "--check")
    assert proc.returncode == 0 and "upstream trace2wl sync sizing" in proc.stdout


# -- fuzzing ---------------------------------------------------------------------------
def _consistent(sim, tmp_path, data, asan_sim=None):
    try:
        parsed = wl.parse(data)
        py_ok = True
    except CorruptFile:
        py_ok = False
    small = (
        py_ok
        and all(sum(a[1:2] or (0,)) < (1 << 24) for ops in parsed.threads for _, a, _ in ops)
        and len(parsed.threads) <= 64
    )
    proc = run_sim(sim, tmp_path, data, *(["--no-fill", "--sample-ms", "50"] if small else ["--check"]))
    assert proc.returncode >= 0, f"simulator crashed with signal {-proc.returncode}"
    if asan_sim:  # the whole fuzz corpus also goes through the sanitized build (with the fill)
        sanitized = run_asan(asan_sim, tmp_path / "w.wl", *(["--sample-ms", "50"] if small else ["--check"]))
        assert sanitized.returncode == proc.returncode, (proc.stderr, sanitized.stderr)
    if proc.returncode == 2 and "exceeds this machine's memory" in proc.stderr:
        return
    if py_ok:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode in (2, 3) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


_stream_op = st.one_of(
    st.builds(lambda i, s: op(wl.MALLOC, i, s), st.integers(0, 9), st.integers(0, 5000)),
    st.builds(lambda i, s: op(wl.CALLOC, i, s), st.integers(0, 9), st.integers(0, 5000)),
    st.builds(lambda i, j, s: op(wl.REALLOC, i, j, s), st.integers(0, 9), st.integers(0, 9), st.integers(0, 9000)),
    st.builds(lambda i: op(wl.FREE, i), st.integers(0, 9)),
    st.builds(lambda i, a, s: op(wl.MEMALIGN, i, a, s), st.integers(0, 9), st.integers(0, 5000), st.integers(0, 5000)),
    st.builds(lambda i, s: op(wl.VALLOC, i, s), st.integers(0, 9), st.integers(0, 5000)),
    st.builds(lambda i, s: op(wl.PVALLOC, i, s), st.integers(0, 9), st.integers(0, 5000)),
    st.builds(lambda k: op(wl.SYNC_W, k), st.integers(0, 6)),
    st.builds(lambda k: op(wl.SYNC_R, k), st.integers(0, 6)),
    st.just(b"\x00"),
    st.binary(min_size=1, max_size=3),
)


_workloads = st.builds(
    lambda streams, nptrs, nsyncs: wl.build(nptrs, nsyncs, [b"".join(s) + b"\x01" for s in streams]),
    st.lists(st.lists(_stream_op, max_size=12), min_size=0, max_size=4),
    st.integers(0, 10),
    st.integers(0, 6),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(_workloads)
def test_fuzz_structured_workloads(sim, asan_sim, tmp_path, data):
    _consistent(sim, tmp_path, data, asan_sim)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=64), st.integers(0, 63), st.binary(max_size=4))
def test_fuzz_mutated_and_random_bytes(sim, asan_sim, tmp_path, raw, pos, patch):
    mutated = bytearray(UPSTREAM)
    mutated[pos : pos + len(patch)] = patch
    for data in (raw, bytes(mutated)):
        _consistent(sim, tmp_path, data, asan_sim)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_python_reader_only_raises_corruptfile(raw):
    try:
        wl.parse(raw)
    except CorruptFile:
        pass


def test_live_bytes_beyond_available_memory_stop_cleanly(sim, tmp_path):
    """A workload whose live blocks exceed MemAvailable ends with a clear error before the
    OOM killer would (checked before each allocation is made and filled)."""
    avail = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    body = b"".join(op(wl.MALLOC, i, avail // 2) for i in range(1, 5))
    proc = run_sim(sim, tmp_path, one_thread(body), "--no-fill")
    assert proc.returncode == 4, proc.stderr
    assert "requested, plus allocator overhead and alignment), more than the" in proc.stderr
    assert "bytes of memory available here (" in proc.stderr and len(proc.stderr.splitlines()) == 1


# -- hostile bounds: each finishes fast with one line or a bounded run -----------------------
def streams_at(rel_offsets, body):
    """A workload whose threads start at REL_OFFSETS (relative to BODY, which follows the header)."""
    head = op(wl.ALLOC_PTRS, 4) + op(wl.ALLOC_SYNCS, 2) + op(wl.NTHREADS, len(rel_offsets))
    off = 0
    for _ in range(4):  # the header's length depends on the offsets' varint lengths
        header = head + b"".join(op(wl.START_THREAD, off + r) for r in rel_offsets) + b"\x01"
        off = len(header)
    return header + body


def test_validation_is_linear_not_threads_times_stream(sim, tmp_path):
    """65,536 threads sharing one 1 MB stream took 111 s to --check: every op is now decoded
    and dry-run once, however many threads share it (also when each starts at another byte)."""
    stream = op(wl.SYNC_W, 1) + b"\x00" * (1 << 20) + op(wl.SYNC_R, 1) + b"\x01"
    for rel in ([0] * 65536, [0] + [2 + t for t in range(65535)]):
        data = streams_at(rel, stream)
        path = tmp_path / "shared.wl"
        path.write_bytes(data)
        t0 = time.monotonic()
        proc = subprocess.run([sim, "--check", str(path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and "65536 threads" in proc.stdout, proc.stderr
        assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    parsed = wl.parse(data)
    assert time.monotonic() - t0 < 30 and len(parsed.offsets) == 65536


def test_shared_streams_share_their_fate_in_the_dry_run(sim, tmp_path):
    """Threads that reach the same bytes stop there and share the first thread's outcome:
    stuck together, or released together when another thread writes the sync."""
    waiter = b"\x00\x00" + op(wl.SYNC_R, 1) + op(wl.MALLOC, 1, 8) + op(wl.FREE, 1) + b"\x01"
    stuck = streams_at([0, 0, 1], waiter)  # the third joins the first at its second NOP
    with pytest.raises(CorruptFile, match=r"thread 0 waits at byte \d+ for sync id 1 \(never written\); thread 1"):
        wl.parse(stuck)
    proc = run_sim(sim, tmp_path, stuck, "--check")
    assert proc.returncode == 3 and "3 of 3 threads can never finish" in proc.stderr, proc.stderr
    released = streams_at([0, 0, len(waiter)], waiter + op(wl.SYNC_W, 1) + b"\x01")
    parsed = wl.parse(released)
    assert parsed.threads[0] is parsed.threads[1] and len(parsed.threads[0]) == 5
    proc = run_sim(sim, tmp_path, released, "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["calls"]["malloc"]["count"] == 2


@pytest.mark.parametrize("sync", ["futex", "mutex"])
def test_sync_tables_sized_by_the_ids_used(sim, tmp_path, sync):
    """15 bytes declaring 2**40 sync ids made `--sync mutex` initialise 2**40 mutexes (OOM)."""
    data = (
        op(wl.ALLOC_PTRS, 1) + op(wl.ALLOC_SYNCS, 1 << 40) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 14) + b"\x01\x01"
    )
    assert wl.parse(data).nsyncs == 1 << 40
    proc = run_sim(sim, tmp_path, data, "--sync", sync, "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["max_rss_kb"] < 64 << 10
    # one id near the top: the tables are reserved lazily (or refused in one line)
    data = wl.build(1, 1 << 40, [op(wl.SYNC_W, (1 << 40) - 1) + op(wl.SYNC_R, (1 << 40) - 1) + b"\x01"])
    proc = run_sim(sim, tmp_path, data, "--sync", sync)
    assert proc.returncode in (0, 4) and (proc.returncode == 0 or len(proc.stderr.splitlines()) == 1), proc.stderr


def test_guard_counts_the_real_footprint(sim, tmp_path):
    """MEMALIGN(2**30, 1) costs pages (and page tables), not 1 byte: the guard counted 131 KB
    for 200,000 of them that took 1.5 GB. Its count must not be below what the blocks took.
    200 of them: where transparent huge pages are "always" (Debian's kernels) each takes a 2 MiB
    huge page, and 2,000 would not fit a 4 GB test VM (the guard refused them there, rightly)."""
    n = 200
    body = b"".join(op(wl.MEMALIGN, i, 1 << 30, 1) for i in range(1, n + 1))
    proc = run_sim(sim, tmp_path, wl.build(n + 1, 0, [body + b"\x01"]), "--json", "-")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["ideal_rss_peak_bytes"] == n
    grew = (r["max_rss_kb"] - r["max_rss_start_kb"]) * 1024
    assert grew > n * 4096  # the blocks really cost pages
    assert r["footprint_peak_bytes"] >= grew
