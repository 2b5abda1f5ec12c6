"""The heap source's user-space halves without BPF: the log2 table its exponential draw
uses (and that draw's arithmetic, pymtrace.sources.heap.draw_bytes), and the ring-record
decoder (bpf/heap.h's hp_event, built by pymtrace.bpf.structs)."""

import ctypes
import math
import os
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymtrace.bpf import structs
from pymtrace.errors import PymtraceError
from pymtrace.sources.heap import HeapSource, draw_bytes, log2_table, probe_plan

TABLE = log2_table()


def test_log2_table_endpoints_and_monotone():
    assert len(TABLE) == structs.header("heap").consts["HP_LG_ENTRIES"]
    assert TABLE[0] == 0 and TABLE[-1] == 1 << 20
    assert all(a < b for a, b in zip(TABLE, TABLE[1:]))


@settings(max_examples=2000, deadline=None)
@given(x=st.integers(0, 2**32 - 1), mean=st.integers(2, 2**32 - 1))
def test_draw_is_minus_mean_ln_u(x, mean):
    """The fixed-point draw is -mean * ln(U), U = (x | 1) / 2^32, to a few parts per million
    (ln 2 as 45426 / 2^16, the table's rounding, linear interpolation between its entries)."""
    exact = -mean * math.log((x | 1) / 2**32)
    assert abs(draw_bytes(x, mean, TABLE) - exact) <= 1e-5 * exact + 4e-6 * mean + 2


def test_draw_mean_and_small_tail():
    """Over a uniform grid of x the draws average to the mean, and P(draw <= mean / 32768)
    matches 1 - exp(-1/32768): small blocks get their right sampling probability (a draw
    without the interpolation makes it about 2x too high)."""
    mean, n = 1 << 19, 1 << 20
    step = 2**32 // n
    draws = [draw_bytes(i * step + step // 2, mean, TABLE) for i in range(n)]
    assert abs(sum(draws) / n / mean - 1) < 1e-3
    small = sum(1 for d in draws if d <= mean // 32768) / n
    assert abs(small / -math.expm1(-1 / 32768) - 1) < 0.05


def _event(**fields):
    ev = structs.header("heap").structs["hp_event"]()
    for k, v in fields.items():
        setattr(ev, k, v)
    return ev


def _record(data):
    """A ring record's bytes at a fixed address: (buffer, address, size)."""
    buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
    return buf, ctypes.addressof(buf), len(data)


def test_sample_record_decoded_in_place():
    got = []
    c = HeapSource({os.getpid()}, sample_bytes=1, on_sample=got.append)
    consts = structs.header("heap").consts
    stack = bytes(range(256)) * 4
    ev = _event(type=consts["HP_REC_SAMPLE"], pid=7, tid=8, call=consts["CALL_POSIX_MEMALIGN"], size=4096, ts=99, id=5)
    ev.regs[:] = list(range(10, 18))
    ev.stack_len = len(stack)
    buf, address, size = _record(bytes(ev) + stack)
    c._record(address, size)
    (s,) = got
    assert (s.pid, s.tid, s.call, s.size, s.ts_ns, s.sample_id) == (7, 8, "posix_memalign", 4096, 99, 5)
    assert s.regs == tuple(range(10, 18))
    assert ctypes.string_at(s.stack, s.stack_len) == stack


def test_truncated_stack_length_is_clamped_to_the_record():
    got = []
    c = HeapSource({os.getpid()}, sample_bytes=1, on_sample=got.append)
    ev = _event(type=structs.header("heap").consts["HP_REC_SAMPLE"], call=1, stack_len=4096)
    buf, address, size = _record(bytes(ev) + b"\1" * 16)
    c._record(address, size)
    assert got[0].stack_len == 16


def test_a_thread_clone_is_not_a_fork():
    forks = []
    c = HeapSource({os.getpid()}, follow_forks=True, on_fork=lambda p, ch: forks.append((p, ch)))
    started, stop = threading.Event(), threading.Event()
    tids = []

    def body():
        tids.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=body)
    t.start()
    started.wait()
    child = subprocess.Popen(["sleep", "5"])
    try:
        c._fork(os.getpid(), tids[0])
        c._fork(os.getpid(), child.pid)
    finally:
        stop.set()
        t.join()
        child.kill()
        child.wait()
    assert forks == [(os.getpid(), child.pid)]


def test_probe_plan_allocating_functions_at_entry_and_free_where_top_probes_it():
    """The copied stack must hold the caller's return address, which an allocating function's
    uretprobe replaces once +0 has run: those entries stay at +0; free goes where top's does."""
    from pymtrace.sources import malloc
    from pymtrace.tracee import libc, mallocapi

    path = libc.system_libc()
    plan = dict(probe_plan(path))
    for function, probes in plan.items():
        if function == "free":
            top = [(kind, off) for kind, off, _ in dict(malloc.probe_plan(path))["free"]]
            assert [(kind, off) for kind, off, _ in probes] == top
            assert {fn for _, _, fn in probes} == {"hp_free_entry"}
        else:
            call = next(f.call for f in mallocapi.FUNCTIONS if f.name == function)  # aligned_alloc: memalign
            assert ("entry", 0, f"hp_{call}_entry") in probes
            assert ("return", 0, "hp_return") in probes


def test_probe_plan_of_a_file_without_the_malloc_api_is_one_error():
    with pytest.raises(PymtraceError, match="no malloc/free symbols"):
        probe_plan("/bin/true")


_DRAWS = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
draw = lib.pymtrace_sample_draw
draw.restype, draw.argtypes = ctypes.c_int64, [ctypes.c_uint32, ctypes.c_uint64]
for line in sys.stdin:
    x, mean = map(int, line.split())
    print(draw(x, mean))
"""


def test_the_interposers_draw_is_the_bpf_draw():
    """heap's in-process sampler (tracee/native/interpose.c, its own log2 table computed
    without libm) draws what hp_draw draws: equal to draw_bytes for every table index, at the
    leading bit's every position, over means from 2 to 2^32 - 1 (loaded in a child process,
    not into the test runner)."""
    import random

    from pymtrace.sources import interposer

    rng = random.Random(29)
    means = [2, 3, 1000, 65536, 524288, 2**32 - 1] + [rng.randrange(2, 2**32) for _ in range(6)]
    cases = [
        ((1 << k) | (j << max(k - 10, 0)) | rng.getrandbits(max(k - 10, 0)), m)
        for k in range(32)
        for j in range(1024)
        if k >= 10 or j >> k == 0
        for m in means[:2]
    ]
    cases += [(rng.getrandbits(32), rng.choice(means)) for _ in range(50000)]
    text = "".join(f"{x & 0xFFFFFFFF} {m}\n" for x, m in cases)
    out = subprocess.run(
        [sys.executable, "-c", _DRAWS, interposer.library()], input=text, capture_output=True, text=True, check=True
    ).stdout.split()
    assert [int(v) for v in out] == [draw_bytes(x & 0xFFFFFFFF, m, TABLE) for x, m in cases]
