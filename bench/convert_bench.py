#!/usr/bin/env python3
"""Benchmark of trace conversion mtrace-bin <-> parquet (not a timed test; no root needed).

For each TRACE (an mtrace-bin recording; default: a synthetic 2M-record malloc/free storm),
interleaved rounds of `pymtrace convert`'s two vectorized paths, in process, CPU time
(time.process_time): records per second min/median, and bytes per record of each format.
Usage: bench/convert_bench.py [TRACE...] [--rounds R] [--markdown]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchutil import print_table  # noqa: E402

from pymtrace.trace.formats import mtrace_bin as B  # noqa: E402
from pymtrace.trace.formats import parquet as P  # noqa: E402


def synthetic(path, n=2_000_000):
    """A storm-like trace: malloc/free pairs of 64 bytes from one thread, 1.4 us apart."""
    recs = numpy.zeros(n, B.record_dtype("<"))
    recs["thread"] = 4242
    recs["type"] = numpy.where(numpy.arange(n) % 2, B.FREE, B.MALLOC)
    recs["ptr2"][::2] = 0x55550000
    recs["ptr1"][1::2] = 0x55550000
    recs["size"][::2] = 64
    recs["size3"][::2] = 80
    recs["size2"][1::2] = 80
    recs["time_ns"] = 10**12 + 1400 * numpy.arange(n, dtype=numpy.uint64)
    recs["caller"] = 0x401136
    with open(path, "wb") as f:
        f.write(B.magic_record(4242))
        f.write(recs.tobytes())


def one_round(src, tmp):
    dst = os.path.join(tmp, f"r{time.monotonic_ns()}.parquet")
    back = dst + ".bin"
    t0 = time.process_time()
    with open(dst, "xb") as out:
        n = P.convert_to_parquet(src, "mtrace-bin", out)
    t1 = time.process_time()
    with open(back, "xb") as out:
        P.write_mtrace_bin(dst, out)
    t2 = time.process_time()
    size = os.path.getsize(dst)
    with open(src, "rb") as a, open(back, "rb") as b:
        identical = a.read() == b.read()
    os.unlink(dst)
    os.unlink(back)
    return n, n / (t1 - t0), n / (t2 - t1), size, identical


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        traces = args.traces
        if not traces:
            traces = [os.path.join(tmp, "synthetic-storm.bin")]
            synthetic(traces[0])
        results = {t: [] for t in traces}
        for _ in range(args.rounds):
            for t in traces:
                results[t].append(one_round(t, tmp))
        for t, res in results.items():
            n = res[0][0]
            to_pq = [r[1] for r in res]
            to_bin = [r[2] for r in res]
            rows.append(
                {
                    "trace": os.path.basename(t),
                    "records": n,
                    "rounds": args.rounds,
                    "bin_to_parquet_Mrec_per_s_min": round(min(to_pq) / 1e6, 2),
                    "bin_to_parquet_Mrec_per_s_median": round(statistics.median(to_pq) / 1e6, 2),
                    "parquet_to_bin_Mrec_per_s_min": round(min(to_bin) / 1e6, 2),
                    "parquet_to_bin_Mrec_per_s_median": round(statistics.median(to_bin) / 1e6, 2),
                    "mtrace_bin_bytes_per_record": round(os.path.getsize(t) / n, 2),
                    "parquet_bytes_per_record": round(res[0][3] / n, 2),
                    "byte_identical": all(r[4] for r in res),
                }
            )
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
