""".wl reader (Python) and the native simulator's input validation: corrupt, truncated and
hostile workloads give one clear error line, never a crash or a hang; both are fuzzed and must
agree on what is valid."""
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymtrace.errors import CorruptFile
from pymtrace.formats import wl

TIMEOUT = 20


@pytest.fixture(scope="session")
def sim():
    from pymtrace import replay
    return replay.simulator_path()


def op(o, *args):
    return wl.encode_op(o, *args)


def one_thread(body, nptrs=8, nsyncs=4):
    return wl.build(nptrs, nsyncs, [body + bytes((wl.DONE,))])


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
    "sync cycle": (wl.build(4, 4, [op(wl.SYNC_R, 1) + op(wl.SYNC_W, 2) + b"\x01",
                                   op(wl.SYNC_R, 2) + op(wl.SYNC_W, 1) + b"\x01"]), "deadlock"),
    "truncated varint": (one_thread(b"")[:-1] + bytes((wl.MALLOC, 1, 0x85)), "truncated"),
    "no DONE": (one_thread(op(wl.MALLOC, 1, 8))[:-1], "truncated"),
    "header without DONE": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1), "header has no DONE"),
    "no ALLOC_PTRS": (op(wl.NTHREADS, 0) + b"\x01", "no ALLOC_PTRS"),
    "offset beyond the file": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 999) + b"\x01",
                               "outside the file body"),
    "offset inside the header": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1) + op(wl.START_THREAD, 0) + b"\x01\x01",
                                 "outside the file body"),
    "NTHREADS mismatch": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 2) + op(wl.START_THREAD, 7) + b"\x01\x01",
                          "NTHREADS says 2"),
    "varint over 64 bits": (one_thread(bytes((wl.MALLOC, 1)) + b"\xff" * 10 + b"\x01"), "exceeds 64 bits"),
    "absurd alignment": (one_thread(op(wl.MEMALIGN, 1, 1 << 50, 8)), "alignment"),
    "too many threads": (op(wl.ALLOC_PTRS, 4) + op(wl.NTHREADS, 1 << 30) + b"\x01", "threads"),
    "empty file": (b"", ""),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_workloads(case, sim, tmp_path):
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


def test_huge_tables_rejected_cleanly(sim, tmp_path):
    data = op(wl.ALLOC_PTRS, 1 << 39) + op(wl.ALLOC_SYNCS, 1 << 39) + op(wl.NTHREADS, 1) + \
        op(wl.START_THREAD, 0) + b"\x01"
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


def test_racing_threads_on_one_slot_do_not_double_free(sim, tmp_path):
    """Hostile but valid-looking: two unsynchronised threads free the same slot many times."""
    body = op(wl.MALLOC, 1, 64) + op(wl.FREE, 1)
    data = wl.build(4, 1, [body * 2000 + b"\x01", op(wl.FREE, 1) * 4000 + b"\x01"])
    proc = run_sim(sim, tmp_path, data)
    assert proc.returncode == 0, proc.stderr


def test_upstream_sized_sync_ids_accepted(sim, tmp_path):
    from test_workload import UPSTREAM  # the reference vector as upstream wrote it
    assert wl.parse(UPSTREAM).upstream_sync_sizing
    proc = run_sim(sim, tmp_path, UPSTREAM, "--check")
    assert proc.returncode == 0 and "upstream trace2wl sync sizing" in proc.stdout


# -- fuzzing ---------------------------------------------------------------------------
def _consistent(sim, tmp_path, data):
    try:
        parsed = wl.parse(data)
        py_ok = True
    except CorruptFile:
        py_ok = False
    small = py_ok and all(sum(a[1:2] or (0,)) < (1 << 24) for ops in parsed.threads for _, a, _ in ops) \
        and len(parsed.threads) <= 64
    proc = run_sim(sim, tmp_path, data, *(["--no-fill", "--sample-ms", "50"] if small else ["--check"]))
    assert proc.returncode >= 0, f"simulator crashed with signal {-proc.returncode}"
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
    st.integers(0, 10), st.integers(0, 6))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(_workloads)
def test_fuzz_structured_workloads(sim, tmp_path, data):
    _consistent(sim, tmp_path, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.integers(0, 63), st.binary(max_size=4))
def test_fuzz_mutated_and_random_bytes(sim, tmp_path, raw, pos, patch):
    from test_workload import UPSTREAM
    mutated = bytearray(UPSTREAM)
    mutated[pos:pos + len(patch)] = patch
    for data in (raw, bytes(mutated)):
        _consistent(sim, tmp_path, data)


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
    assert "requested bytes live, more than the" in proc.stderr and "bytes of memory available here" in proc.stderr
