"""`pymtrace workload`: trace -> .wl conversion, the reference vector, the upstream defects
it fixes (one test each), streaming in bounded memory, and fuzzing of its trace input."""

import io
import os
import stat
import subprocess
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli import PYMTRACE, run_pymtrace
from support.replay import REFERENCE_RECORDS, UPSTREAM

from pymtrace.errors import CorruptFile
from pymtrace.trace import workload
from pymtrace.trace.formats import mtrace_bin as mb
from pymtrace.trace.formats import wl

R = mb.Record
A, B = 1000, 1016


def trace_bytes(records, magic_tid=None):
    tid = records[0].thread if magic_tid is None else magic_tid
    return mb.magic_record(tid) + b"".join(mb.pack(r) for r in records)


def convert(records, **kw):
    out = io.BytesIO()
    warnings = []
    kw.setdefault("warn", warnings.append)
    stats, counts = workload.convert_stream(io.BytesIO(trace_bytes(records)), out, **kw)
    return out.getvalue(), stats, warnings


def test_reference_vector_upstream_compat_is_byte_exact():
    data, stats, _ = convert(REFERENCE_RECORDS, compat=True)
    assert data == UPSTREAM
    assert stats["inversions_fixed"] == 1 and stats["invalid_frees"] == 1 and stats["null_results"] == 1
    # requested live bytes in trace order peak after B's memalign(64, 100): 100 + 64
    assert stats["ideal_rss_bytes"] == 164


def test_reference_vector_default_differs_only_in_sync_array_size():
    """The only fix that applies to the reference trace: ALLOC_SYNCS is m+1 for ids 1..m."""
    data, _, warnings = convert(REFERENCE_RECORDS)
    assert len(data) == len(UPSTREAM)
    diff = [(i, UPSTREAM[i], data[i]) for i in range(len(data)) if data[i] != UPSTREAM[i]]
    assert diff == [(3, 4, 5)]  # header: 09 04 -> 09 05
    assert any("invalid free(0x999)" in w and "never allocated" in w for w in warnings)
    parsed = wl.parse(data)
    assert not parsed.upstream_sync_sizing
    assert wl.parse(UPSTREAM).upstream_sync_sizing  # upstream's files are still accepted


def test_varint_examples():
    assert wl.encode_varint(16) == b"\x10"
    assert wl.encode_varint(1 << 40) == bytes.fromhex("a08080808000")
    assert wl.decode_varint(bytes.fromhex("a08080808000"), 0) == (1 << 40, 6)


def _streams(data):
    return wl.parse(data).threads


def test_tids_differing_in_low_bits_stay_separate_threads():
    recs = [
        R(1000, mb.MALLOC, 0, 0x1000, 8),
        R(1001, mb.MALLOC, 0, 0x2000, 8),
        R(1001, mb.FREE, 0x2000),
        R(1000, mb.FREE, 0x1000),
    ]
    data, stats, _ = convert(recs)
    assert stats["threads"] == 2 and len(_streams(data)) == 2
    upstream, ustats, _ = convert(recs, compat=True)
    assert ustats["threads"] == 1  # the upstream defect, reproduced only in compat mode


def test_posix_memalign_takes_part_in_cross_thread_ordering():
    # B gets 0x5000 from posix_memalign after A freed it: B must wait for A's free
    recs = [
        R(A, mb.MALLOC, 0, 0x5000, 64),
        R(B, mb.MALLOC, 0, 0x9000, 8),
        R(A, mb.FREE, 0x5000),
        R(B, mb.POSIX_MEMALIGN, 0, 0x5000, 48, 32),
        R(A, mb.MALLOC, 0, 0x7000, 8),
        R(A, mb.FREE, 0x5000 + 0),
    ]  # A frees B's block: needs B's posix_memalign first
    data, _, _ = convert(recs)
    a_ops, b_ops = _streams(data)
    b_names = [wl.OP_NAMES[op] for op, _, _ in b_ops]
    a_names = [wl.OP_NAMES[op] for op, _, _ in a_ops]
    # B: start sync, malloc, SYNC_R (A's free of 0x5000 happened first), MEMALIGN, SYNC_W (A frees it later)
    assert b_names == ["SYNC_R", "MALLOC", "SYNC_R", "MEMALIGN", "SYNC_W"]
    assert a_names[-2:] == ["SYNC_R", "FREE"]
    compat, _, _ = convert(recs, compat=True)
    ca, cb = ([wl.OP_NAMES[op] for op, _, _ in ops] for ops in _streams(compat))
    # upstream: B's posix_memalign may run before A's free of the same address, and A's
    # later free of B's block does not wait for it at all (a race at replay)
    assert cb == ["SYNC_R", "MALLOC", "MEMALIGN"]
    assert ca[-2:] == ["MALLOC", "FREE"]


def test_sync_ids_sized_correctly():
    data, stats, _ = convert(REFERENCE_RECORDS)
    parsed = wl.parse(data)
    used = {args[0] for ops in parsed.threads for op, args, _ in ops if op in (wl.SYNC_W, wl.SYNC_R)}
    assert used == {1, 2, 3, 4} and parsed.nsyncs == 5 and max(used) < parsed.nsyncs


def test_valloc_pvalloc_opcodes():
    recs = [
        R(A, mb.VALLOC, 0, 0x1000, 100, 4096),
        R(A, mb.PVALLOC, 0, 0x3000, 5000),
        R(A, mb.FREE, 0x1000),
        R(A, mb.FREE, 0x3000),
    ]
    data, _, _ = convert(recs)
    ops = _streams(data)[0]
    assert [(wl.OP_NAMES[op], args) for op, args, _ in ops] == [
        ("VALLOC", (2, 100)),
        ("PVALLOC", (3, 5000)),
        ("FREE", (2,)),
        ("FREE", (3,)),
    ]


def test_valloc_pvalloc_as_memalign_for_upstream_trace_run():
    recs = [
        R(A, mb.VALLOC, 0, 0x1000, 100, 4096),
        R(A, mb.PVALLOC, 0, 0x3000, 5000),
        R(A, mb.PVALLOC, 0, 0x5000, 0),
        R(A, mb.VALLOC, 0, 0, 1 << 50, 4096),
    ]
    data, _, _ = convert(recs, valloc_as_memalign=True)
    ops = [(wl.OP_NAMES[op], args) for op, args, _ in _streams(data)[0]]
    assert ops == [
        ("MEMALIGN", (2, 4096, 100)),
        ("MEMALIGN", (3, 4096, 8192)),
        ("MEMALIGN", (4, 4096, 4096)),
        ("MEMALIGN", (0, 4096, 1 << 50)),
    ]


def test_multi_level_inversion_repaired():
    """Two allocations of 0x1000 recorded before the frees that preceded them (two levels)."""
    recs = [
        R(A, mb.MALLOC, 0, 0x1000, 10),  # A owns 0x1000
        R(B, mb.MALLOC, 0, 0x1000, 20),  # inversion 1: B got it after A's free
        R(3000, mb.MALLOC, 0, 0x1000, 30),  # inversion 2: after B's free
        R(A, mb.FREE, 0x1000),
        R(B, mb.FREE, 0x1000),
        R(3000, mb.FREE, 0x1000),
    ]
    data, stats, warnings = convert(recs)
    assert stats["inversions_fixed"] == 2 and stats["inversions_unrepaired"] == 0 and not warnings
    parsed = wl.parse(data)  # also proves it is deadlock-free
    flat = {t: [(wl.OP_NAMES[op], args) for op, args, _ in ops] for t, ops in enumerate(parsed.threads)}
    assert [x for x in flat[1] if x[0] in ("MALLOC", "FREE")] == [("MALLOC", (2, 20)), ("FREE", (2,))]
    assert [x for x in flat[2] if x[0] in ("MALLOC", "FREE")] == [("MALLOC", (2, 30)), ("FREE", (2,))]
    # upstream keeps only the last inversion and says so
    _, ustats, uwarn = convert(recs, compat=True)
    assert any("multi-level inversion" in w for w in uwarn)


def test_unrepaired_inversion_reported_precisely():
    recs = [R(A, mb.MALLOC, 0, 0x1000, 10), R(B, mb.MALLOC, 0, 0x1000, 20), R(B, mb.MALLOC, 0, 0x2000, 5)]
    data, stats, warnings = convert(recs)
    assert stats["inversions_unrepaired"] == 1
    assert warnings == [
        "record 2: thread 1016 malloc -> 0x1000 not replayed: the address was still allocated "
        "(malloc at record 1) and is never freed before the end of the trace (unrepaired inversion)"
    ]
    wl.parse(data)


def test_memalign_and_realloc_inversions_repaired():
    recs = [
        R(A, mb.MALLOC, 0, 0x1000, 10),
        R(B, mb.MEMALIGN, 0, 0x1000, 64, 32),
        R(A, mb.MALLOC, 0, 0x2000, 10),
        R(B, mb.REALLOC, 0x9000, 0x2000, 99),  # realloc of unknown ptr
        R(A, mb.FREE, 0x1000),
        R(A, mb.FREE, 0x2000),
    ]
    data, stats, _ = convert(recs)
    assert stats["inversions_fixed"] == 2 and stats["inversions_unrepaired"] == 0
    ops_b = [wl.OP_NAMES[op] for op, _, _ in wl.parse(data).threads[1]]
    assert "MEMALIGN" in ops_b and "REALLOC" in ops_b


def test_failed_realloc_keeps_block():
    recs = [R(A, mb.MALLOC, 0, 0x1000, 10), R(A, mb.REALLOC, 0x1000, 0, 1 << 50), R(A, mb.FREE, 0x1000)]
    data, stats, warnings = convert(recs)
    assert stats["invalid_frees"] == 0 and not warnings
    ops = [(wl.OP_NAMES[op], args) for op, args, _ in wl.parse(data).threads[0]]
    assert ops == [("MALLOC", (2, 10)), ("REALLOC", (0, 2, 1 << 50)), ("FREE", (2,))]


def test_stdin_and_cli(tmp_path):
    out = tmp_path / "ref.wl"
    proc = subprocess.run(
        PYMTRACE + ["workload", "-", "-o", str(out), "--upstream-compat"],
        input=trace_bytes(REFERENCE_RECORDS),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == UPSTREAM
    assert b"13 calls, 2 threads, 4 syncs" in proc.stdout
    assert b"invalid free(0x999)" in proc.stderr
    # to stdout as well
    proc = subprocess.run(
        PYMTRACE + ["workload", "-", "-o", "-"], input=trace_bytes(REFERENCE_RECORDS), capture_output=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout[3] == 5 and proc.stdout[4:] == UPSTREAM[4:]


def test_cli_errors(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"\x01" * 100)
    proc = run_pymtrace("workload", bad, "-o", tmp_path / "x.wl")
    assert proc.returncode == 2 and "not an mtrace binary trace" in proc.stderr
    assert not (tmp_path / "x.wl").exists()
    trunc = tmp_path / "trunc.trace"
    trunc.write_bytes(trace_bytes(REFERENCE_RECORDS)[:-10])
    proc = run_pymtrace("workload", trunc, "-o", tmp_path / "y.wl")
    assert proc.returncode == 2 and "truncated" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_pymtrace("workload", tmp_path / "missing", "-o", tmp_path / "z.wl")
    assert proc.returncode == 1 and "cannot read" in proc.stderr


def test_output_never_written_through_planted_symlinks(tmp_path):
    """A symlink at a guessable temporary name (OUTPUT.tmpPID) or at OUTPUT itself is
    never followed; outputs are 0600; an existing output is refused unless --force."""
    src = tmp_path / "t.trace"
    src.write_bytes(trace_bytes(REFERENCE_RECORDS))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out.wl"
    old_tmp = tmp_path / f"out.wl.tmp{os.getpid()}"
    old_tmp.symlink_to(victim)
    workload.convert_file(str(src), str(out), warn=lambda m: None)
    assert victim.read_text() == "precious" and old_tmp.is_symlink()
    assert len(wl.parse(out.read_bytes()).threads) == 2 and stat.S_IMODE(out.stat().st_mode) == 0o600
    # through the CLI: the existing output is refused, with a symlink there too
    proc = run_pymtrace("workload", src, "-o", out)
    assert (
        proc.returncode == 1
        and proc.stderr.strip() == f"pymtrace: error: {out} exists; choose another file or use --force"
    )
    link = tmp_path / "link.wl"
    link.symlink_to(victim)
    proc = run_pymtrace("workload", src, "-o", link)
    assert proc.returncode == 1 and "exists" in proc.stderr and "Traceback" not in proc.stderr
    assert victim.read_text() == "precious"
    proc = run_pymtrace("workload", src, "-o", link, "--force")
    assert proc.returncode == 0, proc.stderr
    assert not link.is_symlink() and link.read_bytes() == out.read_bytes() and victim.read_text() == "precious"
    assert stat.S_IMODE(link.lstat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wl", "out.wl", old_tmp.name, "t.trace", "victim"]


class SyntheticTrace(io.RawIOBase):
    """A trace generated on the fly (never held in memory): T threads, each allocating and
    freeing a sliding window of W blocks, with every 5th block freed by the next thread."""

    def __init__(self, nrec, threads=4, window=64):
        self.left = nrec
        self.buf = mb.magic_record(100)
        self.threads, self.window = threads, window
        self.i = 0
        self.live = [[] for _ in range(threads)]

    def readable(self):
        return True

    def _more(self):
        out = []
        for _ in range(1024):
            if self.left <= 0:
                break
            t = self.i % self.threads
            ptr = 0x10000 + 16 * ((self.i * 7919) % (1 << 22))
            while True:  # a fresh address not live anywhere
                if all(ptr not in lv for lv in self.live):
                    break
                ptr += 16
            out.append(mb.pack(R(100 + t, mb.MALLOC, 0, ptr, 32 + self.i % 100)))
            self.live[t].append(ptr)
            self.left -= 1
            if len(self.live[t]) > self.window and self.left > 0:
                victim = self.live[t].pop(0)
                freer = (t + 1) % self.threads if victim % 5 == 0 else t
                out.append(mb.pack(R(100 + freer, mb.FREE, victim)))
                self.left -= 1
            self.i += 1
        return b"".join(out)

    def readinto(self, b):
        while len(self.buf) < len(b) and self.left > 0:
            self.buf += self._more()
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def _peak_memory(nrec, tmp_path):
    out_path = tmp_path / f"big{nrec}.wl"
    tracemalloc.start()
    try:
        with open(out_path, "wb") as out:
            stats, _ = workload.convert_stream(
                io.BufferedReader(SyntheticTrace(nrec)), out, freed_cache=2000, tmpdir=str(tmp_path)
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, stats, out_path


def test_streaming_memory_bounded(tmp_path):
    """Memory does not grow with the trace: 8x more records, about the same peak."""
    small_peak, _, _ = _peak_memory(20000, tmp_path)
    big_peak, stats, path = _peak_memory(160000, tmp_path)
    assert stats["forgotten_addresses"] > 10000  # the freed-address cache really recycled
    assert big_peak < small_peak * 1.6 + 2e6, (small_peak, big_peak)
    assert stats["pointer_slots"] < 4 * (64 + 2) + 2000 * 2, stats  # indices recycled per thread
    parsed = wl.read_file(path)  # valid and deadlock-free
    assert sum(parsed.counts().get("MALLOC", 0) for _ in [0]) > 70000


def test_progress_bar(tmp_path, capsys):
    pytest.importorskip("tqdm")
    src = tmp_path / "t.trace"
    src.write_bytes(trace_bytes(REFERENCE_RECORDS))
    workload.convert_file(str(src), str(tmp_path / "t.wl"), progress="always", warn=lambda m: None)
    assert "converting" in capsys.readouterr().err


# -- fuzzing the converter's input -------------------------------------------------------
_records = st.lists(
    st.builds(
        R,
        thread=st.sampled_from([1, 2, 9, 10, -5]),
        type=st.sampled_from(
            [mb.MALLOC, mb.CALLOC, mb.FREE, mb.REALLOC, mb.MEMALIGN, mb.VALLOC, mb.PVALLOC, mb.POSIX_MEMALIGN]
        ),
        ptr1=st.sampled_from([0, 0x1000, 0x1008, 0x2000, 22]),
        ptr2=st.sampled_from([0, 0x1000, 0x1008, 0x2000, 0x3000]),
        size=st.integers(0, 1 << 64 - 1),
        size2=st.sampled_from([0, 16, 64, 4096]),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records, st.booleans(), st.integers(1, 4))
def test_fuzz_converter_output_always_valid(records, compat, cache):
    """Any call sequence converts, and the result is a valid, deadlock-free workload."""
    if not records:
        return
    data, stats, _ = convert(records, compat=compat, freed_cache=cache, max_warnings=0)
    parsed = wl.parse(data)
    if not compat:
        assert not parsed.upstream_sync_sizing
    # the inlined fast path (feed_all) writes exactly what record-by-record feed() writes
    slow = workload.Converter(compat=compat, freed_cache=cache, warn=lambda m: None)
    slow.set_magic_thread(records[0].thread)
    for rec in records:
        slow.feed(rec)
    out = io.BytesIO()
    slow_stats = slow.finish(out)
    assert out.getvalue() == data and slow_stats == stats


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=700))
def test_fuzz_converter_raw_bytes(raw):
    """Arbitrary bytes (with or without a MAGIC record) give CorruptFile or a valid workload."""
    for data in (raw, mb.magic_record(1) + raw):
        out = io.BytesIO()
        try:
            workload.convert_stream(io.BytesIO(data), out, warn=lambda m: None)
        except CorruptFile:
            continue
        wl.parse(out.getvalue())
