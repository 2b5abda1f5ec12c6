"""A synthetic malloc trace of any length, generated fast (numpy, in chunks), with its exact
ground truth computed independently of DuckDB: shared by tests/unit/test_analysis.py,
tests/integration/test_analysis_html.py and bench/analyze_bench.py.

Step i (0 <= i < steps) frees the block of step i - SLOTS (when i >= SLOTS) and then makes
allocation i into the same slot (so the same address), so every block lives exactly SLOTS
steps and the last SLOTS blocks are never freed. Events are STEP_NS apart. Allocation i is
malloc, calloc, memalign, posix_memalign or realloc(NULL, n) by i % 20; its size is a hash of
i, every 997th one 200,000 bytes (above glibc's 128 KiB mmap threshold). The thread of step i
is 100 + (i // 3) % THREADS, so a free is cross-thread when that differs from its block's.
"""

import numpy

from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P

STEP_NS = 100
T0 = 10**12
BASE = 0x7F0000000000


def kind_of(i):
    """Call type code of allocation i (numpy array of step numbers)."""
    r = i % 20
    return numpy.select(
        [r < 14, r < 16, r < 17, r < 18], [B.MALLOC, B.CALLOC, B.MEMALIGN, B.POSIX_MEMALIGN], default=B.REALLOC
    ).astype(numpy.uint32)


def size_of(i):
    s = 1 + ((i * 2654435761) >> 5) % 3000
    return numpy.where(i % 997 == 0, 200_000, s).astype(numpy.uint64)


def thread_of(i, threads):
    return (100 + (i // 3) % threads).astype(numpy.int32)


def caller_of(i):
    return (0x401000 + 16 * (i % 5)).astype(numpy.uint64)


def chunk_records(lo, hi, slots, threads):
    """The records of steps [lo, hi), in order."""
    i = numpy.arange(lo, hi, dtype=numpy.int64)
    n = len(i)
    has_free = i >= slots
    nfree = int(has_free.sum())
    recs = numpy.zeros(n + nfree, B.record_dtype("<"))
    # positions: each step's free (if any) comes right before its allocation
    alloc_pos = numpy.arange(n) + numpy.cumsum(has_free)
    free_pos = alloc_pos[has_free] - 1
    first_event = lo + max(0, lo - slots)  # events before step lo: lo allocations + frees of steps < lo
    ptr = (BASE + (i % slots) * 4096).astype(numpy.uint64)
    t_alloc = T0 + STEP_NS * (first_event + alloc_pos).astype(numpy.uint64)
    kinds = kind_of(i)
    sizes = size_of(i)
    a = recs[alloc_pos]
    a["thread"] = thread_of(i, threads)
    a["type"] = kinds
    a["ptr2"] = ptr
    a["size"] = sizes
    a["size3"] = (sizes + 23) & ~numpy.uint64(15)
    a["size2"] = numpy.where(kinds == B.MEMALIGN, 64, numpy.where(kinds == B.POSIX_MEMALIGN, 32, 0))
    a["time_ns"] = t_alloc
    a["caller"] = caller_of(i)
    recs[alloc_pos] = a
    f = recs[free_pos]
    fi = i[has_free]
    f["thread"] = thread_of(fi, threads)
    f["type"] = B.FREE
    f["ptr1"] = ptr[has_free]
    f["size2"] = (size_of(fi - slots) + 23) & ~numpy.uint64(15)
    f["time_ns"] = T0 + STEP_NS * (first_event + free_pos).astype(numpy.uint64)
    f["caller"] = caller_of(fi)
    recs[free_pos] = f
    return recs


def write(path, steps, slots=1000, threads=4, chunk=1 << 20):
    """Write the trace of STEPS steps to PATH (parquet); the number of rows."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        w = P.Writer(fd, P.file_metadata(source_format="synthetic"))
        for lo in range(0, steps, chunk):
            w.write_records(chunk_records(lo, min(steps, lo + chunk), slots, threads))
        w.close()
        return w.rows
    finally:
        os.close(fd)


def truth(steps, slots=1000, threads=4, chunk=1 << 20):
    """The exact numbers analyze must report for write(path, STEPS, SLOTS, THREADS)."""
    counts = numpy.zeros(9, numpy.int64)
    running = 0  # live requested bytes
    peak = 0
    requested = 0
    cross = 0
    for lo in range(0, steps, chunk):
        hi = min(steps, lo + chunk)
        i = numpy.arange(lo, hi, dtype=numpy.int64)
        kinds = kind_of(i)
        counts += numpy.bincount(kinds, minlength=9)
        counts[B.FREE] += int((i >= slots).sum())
        sizes = size_of(i).astype(numpy.int64)
        requested += int(sizes.sum())
        freed = numpy.where(i >= slots, size_of(numpy.maximum(i - slots, 0)).astype(numpy.int64), 0)
        # the free of a step comes before its allocation: live after the free, then after the allocation
        after_free = running + numpy.cumsum(sizes - freed) - sizes
        after_alloc = after_free + sizes
        peak = max(peak, int(after_alloc.max()), int(after_free.max()))
        running = int(after_alloc[-1])
        fi = i[i >= slots]
        cross += int((thread_of(fi, threads) != thread_of(fi - slots, threads)).sum())
    freed_steps = max(0, steps - slots)
    return {
        "counts": {B.TYPE_NAMES[t]: int(counts[t]) for t in range(1, 9) if counts[t]},
        "events": int(counts.sum()),
        "peak_live_bytes": peak,
        "final_live_bytes": running,
        "requested_bytes": requested,
        "freed": freed_steps,
        "never_freed": min(steps, slots),
        "cross_thread_frees": cross,
        # the block of step j (event 2j - SLOTS + 1, or j before any free) is freed at event
        # 2j + SLOTS: 2 * SLOTS - 1 events later, SLOTS + j for the first SLOTS blocks
        "lifetime_min_ns": STEP_NS * slots if steps > slots else None,
        "lifetime_max_ns": STEP_NS * min(2 * slots - 1, steps - 1) if steps > slots else None,
    }


def agrees(rep, truth):
    """Whether the report REP (analyze --json's dict) has the numbers TRUTH (truth()) checks
    most: the benchmarks' check (tests/unit/test_analysis.py asserts these and more one by one)."""
    return (
        rep is not None
        and {n: c["count"] for n, c in rep["calls"].items()} == truth["counts"]
        and rep["live"]["peak_bytes"] == truth["peak_live_bytes"]
        and rep["live"]["final_bytes"] == truth["final_live_bytes"]
        and rep["lifetimes"]["cross_thread_frees"] == truth["cross_thread_frees"]
        and rep["lifetimes"]["min_ns"] == truth["lifetime_min_ns"]
        and rep["never_freed"]["count"] == truth["never_freed"]
    )
