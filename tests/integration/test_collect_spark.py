"""analyze's report on Spark: the dataset `pymtrace collect` writes, reported by `pymtrace analyze
--json` (DuckDB) and by the same report's SQL on Spark (local mode, pymtrace.trace.report_sql):
the same numbers, exactly, but for the lifetime percentiles (approximate in analyze). Spark
needs a JDK (install.sh: openjdk-17).

Slow on the shared 2-core test machine: ~50 s to start the JVM and Spark, then the report's
queries (one session, local[1], small data)."""

import json
import os
import shutil
import time

import numpy
import pytest
from support.cli import run_pymtrace
from support.collect import CollectorProcess
from support.machine import slowness
from support.needs import missing_or_fail

from pymtrace.net import collector as C
from pymtrace.net import protocol, sender
from pymtrace.trace import report_sql
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P


def workload(n, seed):
    """N calls of one made-up process, with what the report counts: every call type, three
    threads (cross-thread frees), realloc in place / moved / to 0 / failed / of NULL, frees of
    NULL, of unknown blocks and double frees, failed mallocs, an address returned twice
    without a free (a lost record), sizes around the mmap threshold, equal times."""
    rng = numpy.random.default_rng(seed)
    recs = numpy.zeros(n, B.record_dtype("<"))
    live = {}  # ptr -> size
    next_ptr = 0x7F0000000000 + seed * 0x10000000
    t = 10**15 + seed
    for i in range(n):
        t += int(rng.integers(0, 3)) * 37  # some equal times
        r = recs[i]
        r["thread"] = 1000 + seed * 10 + int(rng.integers(0, 3))
        r["time_ns"] = t
        r["caller"] = 0x401000 + 16 * int(rng.integers(0, 7))
        size = int(rng.choice([0, 8, 24, 100, 4000, 65536, 131071, 131072, 200000, 1 << 26]))
        k = rng.random()
        if k < 0.35 or not live:
            kind = int(rng.choice([B.MALLOC, B.CALLOC, B.MEMALIGN, B.VALLOC, B.PVALLOC, B.POSIX_MEMALIGN]))
            r["type"], r["size"] = kind, size
            if rng.random() < 0.02:  # failed
                if kind == B.POSIX_MEMALIGN:
                    r["ptr1"] = 12
                continue
            if live and rng.random() < 0.01:  # an address returned again: a lost free record
                ptr = next(iter(live))
            else:
                next_ptr += 0x1000
                ptr = next_ptr
            r["ptr2"], live[ptr] = ptr, size
        elif k < 0.6:
            r["type"] = B.FREE
            u = rng.random()
            if u < 0.03:
                continue  # free(NULL)
            if u < 0.06:
                r["ptr1"] = 0x10000 + int(rng.integers(0, 50)) * 16  # unknown block (or its double free)
                continue
            ptr = list(live)[int(rng.integers(0, len(live)))]
            r["ptr1"] = ptr
            del live[ptr]
        else:
            r["type"], r["size"] = B.REALLOC, size
            u = rng.random()
            old = list(live)[int(rng.integers(0, len(live)))]
            if u < 0.05:  # realloc(NULL, n)
                next_ptr += 0x1000
                r["ptr2"], live[next_ptr] = next_ptr, size
            elif u < 0.1:  # realloc(p, 0): released
                r["ptr1"], r["size"] = old, 0
                del live[old]
            elif u < 0.13:  # failed: nothing released
                r["ptr1"] = old
            elif u < 0.5:  # in place
                r["ptr1"] = r["ptr2"] = old
                live[old] = size
            else:  # moved
                next_ptr += 0x1000
                r["ptr1"], r["ptr2"] = old, next_ptr
                del live[old]
                live[next_ptr] = size
    return recs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two recordings: pid 301 streamed by the recorder's sender to a real collector process,
    pid 302 written as three parts by the collector's Stream (a block allocated in one part
    and freed in a later one is paired across them)."""
    root = tmp_path_factory.mktemp("spark") / "ds"
    c = CollectorProcess(root)
    try:
        meta = P.file_metadata(pid=301, host="h1", start_time="2026-11-24T10:00:00Z")
        out = sender.NetOutput(("127.0.0.1", c.port), protocol.ClientConfig(), 301, meta, quiet=True)
        recs = workload(3000, 1)
        out.write(recs.tobytes(), len(recs))
        out.close()
    finally:
        c.stop()
    meta = P.file_metadata(pid=302, host="h1", start_time="2026-11-24T10:00:00Z")
    stream = C.Stream(str(root), {"stream": "ab" * 16, "pid": 302, "host": "h1", "metadata": meta})
    recs = workload(3000, 2)
    for lo in (0, 1000, 2200):
        stream.add(lo, recs[lo : {0: 1000, 1000: 2200, 2200: 3000}[lo]].tobytes())
        stream.flush()
    assert len(list(root.glob("**/part-*.parquet"))) == 4
    return str(root)


@pytest.fixture(scope="module")
def spark():
    if shutil.which("java") is None:
        missing_or_fail("java is not installed (install.sh: openjdk-17-jre-headless)")
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        missing_or_fail("pyspark is not installed (pip install -e .[test])")
    t0 = time.monotonic()
    # In the emulated Debian VMs with more than one vCPU (PYMTRACE_VM_CPUS=2) the JVM can crash
    # (SIGILL or SIGSEGV in code C1 has just compiled): QEMU's multi-threaded TCG and the JIT's
    # cross-modified code. On one vCPU the emulator sees every write to code before running
    # it: the JVM (spark-submit, started from this thread) inherits this thread's CPUs.
    cpus = os.sched_getaffinity(0)
    if slowness() > 1:
        os.sched_setaffinity(0, {min(cpus)})
    try:
        session = (
            SparkSession.builder.master("local[1]")
            .appName("pymtrace-collect-test")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.adaptive.enabled", "false")  # tiny data: no re-planning stages
            .config("spark.sql.shuffle.partitions", "1")
            .config("spark.driver.memory", "512m")
            # Spark's vectorized Parquet reader cannot read unsigned 64-bit columns stored with
            # DELTA_BINARY_PACKED/BYTE_STREAM_SPLIT (time_ns, size): UNSUPPORTED_CALL readUnsignedLongs
            .config("spark.sql.parquet.enableVectorizedReader", "false")
            .getOrCreate()
        )
    finally:
        os.sched_setaffinity(0, cpus)
    session.sparkContext.setLogLevel("ERROR")
    print(f"spark session started in {time.monotonic() - t0:.1f} s")
    yield session
    session.stop()


def without_percentiles(rep):
    """REP without the lifetime percentiles: analyze's are approximate (DuckDB's t-digest),
    Spark's exact (percentile_disc); everything else is exact in both."""
    rep = json.loads(json.dumps(rep))
    for k in ("p50_ns", "p90_ns", "p99_ns"):
        rep["lifetimes"].pop(k)
    return rep


@pytest.fixture(scope="module")
def analyzed(dataset):
    """`pymtrace analyze --json` of the dataset."""
    return json.loads(run_pymtrace("analyze", dataset, "--json", "--top", "5", check=True).stdout)


def test_analyze_reads_the_dataset_as_its_recordings(analyzed):
    # `symbols` says whether a FILE.stacks table beside the trace named the callers: a file read,
    # not a query (a collect dataset has none: record --stacks --to is refused)
    assert analyzed["symbols"] == {"callers_symbolized": 0, "source": None}
    assert analyzed["totals"]["allocators"] == ["glibc"]
    assert analyzed["totals"]["events"] == 6000 and analyzed["totals"]["files"] == 4
    assert analyzed["realloc_chains"]["chains"] > 0 and analyzed["lifetimes"]["cross_thread_frees"] > 0


def test_spark_gives_the_report_analyze_gives(dataset, spark, analyzed):
    t0 = time.monotonic()
    got = report_sql.spark_report(spark, dataset, top=5).to_json()
    print(f"report on spark: {time.monotonic() - t0:.1f} s")
    # files, settings and symbols are what analyze knows of its input files; allocators come
    # from the files' headers, not from a query
    want = json.loads(json.dumps({k: v for k, v in analyzed.items() if k not in ("files", "settings", "symbols")}))
    want["totals"].pop("allocators")
    assert without_percentiles(got) == without_percentiles(want)
    for k in ("p50_ns", "p90_ns", "p99_ns"):  # approximate in analyze
        assert got["lifetimes"][k] == pytest.approx(want["lifetimes"][k], rel=0.2), k
