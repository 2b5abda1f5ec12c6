"""The dataset `pymtrace collect` writes, read by Spark (pyspark, local mode) and DuckDB: the
same numbers for the same queries. Spark needs a JDK (install.sh: openjdk-17).

Slow on the shared 2-core test machine: ~50 s to start the JVM and Spark, ~5-25 s a query
(one session for the module, local[1])."""

import shutil
import time

import numpy
import pytest
from conftest import missing_or_fail
from support.collect import CollectorProcess

from pymtrace.trace import netproto, netsink
from pymtrace.trace.formats import mtrace_bin
from pymtrace.trace.formats import parquet as P

# (name, SQL over the view `trace`): the questions a report asks of a recording
QUERIES = [
    ("calls per type", "select type, count(*) as n from trace group by type"),
    ("calls per process and type", "select host, pid, type, count(*) as n from trace group by host, pid, type"),
    ("bytes requested per type", "select type, sum(size) as bytes from trace where ptr2 <> 0 group by type"),
    ("threads per process", "select pid, count(distinct thread) as threads from trace group by pid"),
    ("largest requests", "select pid, max(size) as biggest, min(size) as smallest from trace group by pid"),
    ("frees of NULL", "select pid, count(*) as n from trace where type = 'free' and ptr1 = 0 group by pid"),
]


def workload(n, pid):
    """N records of one made-up process: all call types, several threads, some NULLs."""
    rng = numpy.random.default_rng(pid)
    recs = numpy.zeros(n, mtrace_bin.record_dtype("<"))
    recs["type"] = rng.integers(1, 9, n).astype(numpy.uint32)
    recs["thread"] = rng.integers(pid, pid + 4, n)
    recs["ptr1"] = rng.integers(0, 3, n) * 0x1000
    recs["ptr2"] = rng.integers(0, 1 << 47, n, dtype=numpy.uint64)
    recs["size"] = rng.integers(0, 1 << 20, n, dtype=numpy.uint64)
    recs["time_ns"] = numpy.arange(n, dtype=numpy.uint64)
    return recs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark") / "ds"
    c = CollectorProcess(root)
    try:
        for pid in (301, 302):
            meta = P.file_metadata(pid=pid, host="h1", start_time="2026-11-24T10:00:00Z")
            out = netsink.NetOutput(("127.0.0.1", c.port), netproto.ClientConfig(), pid, meta, quiet=True)
            recs = workload(50_000, pid)
            out.write(recs.tobytes(), len(recs))
            out.close()
    finally:
        c.stop()
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
    session.sparkContext.setLogLevel("ERROR")
    print(f"spark session started in {time.monotonic() - t0:.1f} s")
    yield session
    session.stop()


def normalized(rows):
    return sorted(tuple(int(v) if not isinstance(v, str) else v for v in row) for row in rows)


def test_spark_and_duckdb_agree_on_every_query(dataset, spark):
    import duckdb

    spark.read.parquet(dataset).createOrReplaceTempView("trace")  # partitions discovered from the paths
    con = duckdb.connect()
    con.execute(f"create view trace as select * from read_parquet('{dataset}/**/*.parquet', hive_partitioning=true)")
    for name, sql in QUERIES:
        t0 = time.monotonic()
        want = normalized(con.execute(sql).fetchall())
        got = normalized(tuple(r) for r in spark.sql(sql).collect())
        assert got == want, name
        print(f"{name}: {time.monotonic() - t0:.1f} s")
        assert want, name
    counts = dict(con.execute("select type, count(*) from trace group by type").fetchall())
    assert sum(counts.values()) == 100_000 and set(counts) == set(P.TYPE_NAMES)
