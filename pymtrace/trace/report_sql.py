"""`pymtrace analyze`'s report as SQL that DuckDB and Spark SQL both run (docs/collect.md).

One definition of each report section's query, over a view `trace_rows` (file: the recording's
index, row: the row in its recording, and the trace columns). `analyze` computes the same numbers
its own way (pairing in numpy after a DuckDB sort, bounded memory on one machine); these queries
pair with window functions partitioned by address (`lag`/`lead` over (file, ptr)), which Spark
distributes over a cluster. tests/unit/test_collect_spark.py checks that analyze, this SQL on
DuckDB and this SQL on Spark give the same numbers.

An Engine runs the statements: `rows(sql)` returns tuples, `materialize(name, select)` makes a
table of a SELECT (DuckDB: a temporary table; Spark: a cached view) — the only dialect hook.
`source_sql(dialect, ...)` is the one dialect-specific text: how the dataset's files, their
paths and row numbers are read.

Differences from analyze, by design: the lifetime percentiles are exact here (percentile_disc)
where analyze's are approximate (t-digest); only traces with times (every Parquet recording and
`collect` dataset) get the live-bytes curve and the thread timeline.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Protocol

from pymtrace.trace.analysis import (
    CHAIN_LABELS,
    LIFETIME_BOUNDS,
    LIVE_BUCKETS,
    MMAP_THRESHOLD,
    SIZE_CLASS_BOUNDS,
    THREAD_BUCKETS,
    lifetime_label,
    size_class_label,
)

# a part written by `pymtrace collect`: its stream (one recording) and its first row's offset
PART_PATTERN = "part-([0-9a-f]{32})-([0-9]{12})[.]parquet$"
CHAIN_BOUNDS = [1 << i for i in range(11)]


class Engine(Protocol):
    """What the report needs of a SQL engine."""

    source: str  # source_sql() of the dataset

    def rows(self, sql: str) -> list[tuple]: ...

    def materialize(self, name: str, select: str) -> None: ...


def source_sql(dialect: str, location: str) -> str:
    """A SELECT of the dataset at LOCATION with the columns the report reads and `path` (the
    file) and `idx` (the row in the file): DIALECT "duckdb" (LOCATION: a directory; its
    `**/*.parquet`) or "spark" (LOCATION: anything spark.read.parquet takes, s3a://... too)."""
    cols = "thread, CAST(type AS STRING) AS type, ptr1, ptr2, size, time_ns, caller, stack"
    if dialect == "duckdb":
        where = location.rstrip("/").replace("'", "''") + "/**/*.parquet"
        return (
            f"SELECT {cols.replace('STRING', 'VARCHAR')}, filename AS path, file_row_number AS idx "
            f"FROM read_parquet('{where}', filename = true, file_row_number = true, hive_partitioning = false)"
        )
    if dialect == "spark":
        return f"SELECT {cols}, pymtrace_file AS path, pymtrace_row AS idx FROM pymtrace_dataset"
    raise ValueError(f"unknown SQL dialect {dialect!r}")


def trace_rows_sql(source: str) -> str:
    """The view the report reads, from SOURCE (source_sql): the parts `collect` wrote of one
    stream are one recording, rows counted from each part's first offset (from its name);
    recordings numbered 0, 1, ... in the order of their first file's path (as analyze does)."""
    return f"""
        WITH src AS (
          SELECT s.*, regexp_extract(path, '{PART_PATTERN}', 1) AS stream,
                 regexp_extract(path, '{PART_PATTERN}', 2) AS first_offset
          FROM ({source}) s),
        keyed AS (
          SELECT src.*, CASE WHEN stream <> '' THEN stream ELSE path END AS rec,
                 CASE WHEN stream <> '' THEN CAST(first_offset AS BIGINT) ELSE 0 END AS base
          FROM src),
        recs AS (SELECT rec, dense_rank() OVER (ORDER BY first_path) - 1 AS file
                 FROM (SELECT rec, min(path) AS first_path FROM keyed GROUP BY rec) r)
        SELECT recs.file, keyed.idx + keyed.base AS row, keyed.path, thread, type, ptr1, ptr2, size, time_ns,
               caller, stack
        FROM keyed JOIN recs ON keyed.rec = recs.rec"""


# ---------------------------------------------------------------- the queries (one definition)

ALLOCATING = "type <> 'free'"
FAILED = (
    "CASE WHEN type = 'free' THEN false WHEN type = 'posix_memalign' THEN ptr1 <> 0 "
    "ELSE ptr2 = 0 AND NOT (type = 'realloc' AND size = 0) END"
)
CALL_MIX = f"""
    SELECT type, count(*), count(*) FILTER (WHERE {FAILED}), sum(size) FILTER (WHERE {ALLOCATING}),
           count(*) FILTER (WHERE type = 'free' AND ptr1 = 0)
    FROM trace_rows GROUP BY type"""
TOTALS = """
    SELECT count(*), count(DISTINCT path), min(time_ns) FILTER (WHERE time_ns > 0), max(time_ns),
           count(*) FILTER (WHERE time_ns = 0),
           (SELECT count(*) FROM (SELECT DISTINCT file, thread FROM trace_rows) ft)
    FROM trace_rows"""


def case_bucket(expr: str, bounds: list[int], inclusive: bool) -> str:
    """SQL: the index of the first bound EXPR is <= (inclusive) or < to, else len(bounds)."""
    op = "<=" if inclusive else "<"
    whens = " ".join(f"WHEN {expr} {op} {b} THEN {i}" for i, b in enumerate(bounds))
    return f"CASE {whens} ELSE {len(bounds)} END"


SIZE_HISTOGRAM = f"""
    SELECT {case_bucket("size", SIZE_CLASS_BOUNDS, True)} AS k, count(*) FROM trace_rows
    WHERE {ALLOCATING} GROUP BY 1"""


def mmap_split_sql(threshold: int) -> str:
    t, half, double = int(threshold), int(threshold) // 2, int(threshold) * 2
    return f"""
    SELECT count(*) FILTER (WHERE size < {t}), coalesce(sum(size) FILTER (WHERE size < {t}), 0),
           count(*) FILTER (WHERE size >= {t}), coalesce(sum(size) FILTER (WHERE size >= {t}), 0),
           count(*) FILTER (WHERE size >= {half} AND size < {t}),
           count(*) FILTER (WHERE size >= {t} AND size < {double})
    FROM trace_rows WHERE {ALLOCATING}"""


# Events: every call split into an allocation (of ptr2) and/or a release (of ptr1), realloc both
# (release first: seq = 2 row, allocation 2 row + 1); each with its neighbours at the same address
# in time order. outcome of a realloc's release: 0 in place, 1 moved, 2 released (realloc(p, 0)).
EVENTS = """
    WITH e AS (
      SELECT file, ptr2 AS ptr, time_ns AS t, row, row * 2 + 1 AS seq, true AS alloc, thread, size, caller,
             type, CAST(NULL AS INT) AS outcome
      FROM trace_rows WHERE ptr2 <> 0 AND type <> 'free' AND (type <> 'posix_memalign' OR ptr1 = 0)
      UNION ALL
      SELECT file, ptr1, time_ns, row, row * 2, false, thread, size, caller, type,
             CASE WHEN type <> 'realloc' THEN NULL WHEN ptr2 = 0 THEN 2 WHEN ptr2 = ptr1 THEN 0 ELSE 1 END
      FROM trace_rows WHERE ptr1 <> 0 AND (type = 'free' OR (type = 'realloc' AND (ptr2 <> 0 OR size = 0))))
    SELECT e.*,
           lag(alloc) OVER w AS prev_alloc, lag(size) OVER w AS prev_size, lag(t) OVER w AS prev_t,
           lag(thread) OVER w AS prev_thread, lag(row) OVER w AS prev_row, lead(alloc) OVER w AS next_alloc
    FROM e WINDOW w AS (PARTITION BY file, ptr ORDER BY t, seq)"""
LIFE = "CAST(t - prev_t AS BIGINT)"
PAIRED_RELEASES = "SELECT * FROM ev WHERE NOT alloc AND prev_alloc"
LIFETIMES = f"""
    SELECT count(*) FILTER (WHERE prev_alloc), count(*) FILTER (WHERE prev_alloc AND thread <> prev_thread),
           min({LIFE}) FILTER (WHERE prev_alloc), max({LIFE}) FILTER (WHERE prev_alloc),
           sum({LIFE}) FILTER (WHERE prev_alloc),
           count(*) FILTER (WHERE prev_alloc IS NULL OR NOT prev_alloc)
    FROM ev WHERE NOT alloc"""
LIFETIME_PERCENTILES = f"""
    SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY {LIFE}), percentile_disc(0.9) WITHIN GROUP (ORDER BY {LIFE}),
           percentile_disc(0.99) WITHIN GROUP (ORDER BY {LIFE})
    FROM ({PAIRED_RELEASES}) p"""
LIFETIME_HISTOGRAM = f"""
    SELECT {case_bucket(LIFE, LIFETIME_BOUNDS, False)} AS k, count(*) FROM ({PAIRED_RELEASES}) p GROUP BY 1"""
OVER_LIVE = "SELECT count(*) FROM ev WHERE alloc AND next_alloc"
NEVER_FREED = "SELECT count(*), coalesce(sum(size), 0) FROM ev WHERE alloc AND next_alloc IS NULL"


def never_freed_by_caller_sql(top: int) -> str:
    return f"""SELECT caller, count(*), sum(size) FROM ev WHERE alloc AND next_alloc IS NULL
               GROUP BY caller ORDER BY 3 DESC, 2 DESC, 1 LIMIT {int(top)}"""


LIVE_RANGE = "SELECT count(*), min(t), max(t) FROM ev"


def live_events_sql(lo: int, span: int) -> str:
    """Each event's change of the live requested bytes and its bucket of the curve; x: its
    time from the first event, as analyze computes it (float64(t) - float64(lo))."""
    x = f"(CAST(t AS DOUBLE) - CAST({int(lo)} AS DOUBLE))"
    return f"""
    SELECT file, seq, t, {x} AS x,
           CAST(least({LIVE_BUCKETS - 1}, floor({x} * {LIVE_BUCKETS} / {int(span)})) AS INT) AS b,
           CASE WHEN alloc THEN CAST(size AS BIGINT) WHEN prev_alloc THEN -CAST(prev_size AS BIGINT) ELSE 0 END AS d
    FROM ev"""


# The running sum, distributed: each bucket's events summed in order within the bucket, plus
# the sum of every earlier bucket (a window over the few bucket totals).
LIVE_RUNNING = """
    WITH totals AS (SELECT b, sum(d) AS s FROM live_ev GROUP BY b),
         bases AS (SELECT b, coalesce(sum(s) OVER (ORDER BY b ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                             AS base FROM totals)
    SELECT l.file, l.seq, l.t, l.x, l.b,
           bases.base + sum(l.d) OVER (PARTITION BY l.b ORDER BY l.t, l.file, l.seq ROWS UNBOUNDED PRECEDING) AS live
    FROM live_ev l JOIN bases ON l.b = bases.b"""
LIVE_PEAK = "SELECT live, CAST(floor(x) AS BIGINT) FROM live_run ORDER BY live DESC, t, file, seq LIMIT 1"
LIVE_FINAL = "SELECT coalesce(sum(d), 0) FROM live_ev"
LIVE_POINTS = """
    SELECT b, CAST(floor(x) AS BIGINT), mx, live FROM (
      SELECT b, x, live, max(live) OVER (PARTITION BY b) AS mx,
             row_number() OVER (PARTITION BY b ORDER BY t DESC, file DESC, seq DESC) AS back
      FROM live_run) p
    WHERE back = 1 ORDER BY b"""


def threads_sql(top: int) -> str:
    return f"""
    SELECT file, thread, count(*), count(*) FILTER (WHERE {ALLOCATING}), count(*) FILTER (WHERE type = 'free'),
           coalesce(sum(size) FILTER (WHERE {ALLOCATING}), 0), min(time_ns), max(time_ns)
    FROM trace_rows GROUP BY file, thread ORDER BY 3 DESC, 1, 2 LIMIT {int(top)}"""


CROSS_BY_THREAD = """
    SELECT file, thread, count(*) FROM ev WHERE NOT alloc AND prev_alloc AND thread <> prev_thread
    GROUP BY file, thread"""


def timeline_sql(keys: list[tuple[int, int]], t0: int, span: int) -> str:
    width = max(1, int(span) + 1)
    b = f"CAST(least({THREAD_BUCKETS - 1}, floor(CAST(time_ns - {int(t0)} AS DOUBLE) / {width} * {THREAD_BUCKETS})) AS INT)"
    where = " OR ".join(f"(file = {int(f)} AND thread = {int(th)})" for f, th in keys)
    return f"SELECT file, thread, {b} AS b, count(*) FROM trace_rows WHERE {where} GROUP BY 1, 2, 3"


# Realloc chains: each realloc whose release paired with an allocation links to it; the chains
# are found by pointer jumping, each round doubling the distance covered (log2(longest) rounds).
LINKS = """SELECT file, row, prev_row AS parent, size, outcome FROM ev
           WHERE NOT alloc AND type = 'realloc' AND prev_alloc"""
JUMP_START = "SELECT file, row, parent AS anc, 1 AS dist FROM links"


def jump_round_sql(previous: str) -> str:
    return f"""SELECT a.file, a.row, coalesce(b.anc, a.anc) AS anc, a.dist + coalesce(b.dist, 0) AS dist,
                      b.row IS NOT NULL AS moved_on
               FROM {previous} a LEFT JOIN {previous} b ON a.file = b.file AND a.anc = b.row"""


LINK_STATS = """
    SELECT count(*), count(*) FILTER (WHERE l.outcome = 0), count(*) FILTER (WHERE l.outcome = 1),
           count(*) FILTER (WHERE l.outcome = 2),
           count(*) FILTER (WHERE l.size > e.size), count(*) FILTER (WHERE l.size < e.size)
    FROM links l JOIN ev e ON e.file = l.file AND e.row = l.parent AND e.alloc"""


def chains_sql(jump: str) -> str:
    return f"""SELECT j.file, j.anc AS root, count(*) AS reallocs, max_by(l.size, j.dist) AS final_size,
                      max(l.size) AS max_size, count(*) FILTER (WHERE l.outcome = 1) AS moves
               FROM {jump} j JOIN links l ON j.file = l.file AND j.row = l.row GROUP BY j.file, j.anc"""


CHAIN_HISTOGRAM = f"SELECT {case_bucket('reallocs', CHAIN_BOUNDS, False)} AS k, count(*) FROM chains GROUP BY 1"
CHAIN_COUNT = "SELECT count(*) FROM chains"


def longest_chains_sql(top: int) -> str:
    return f"""SELECT c.file, e.thread, e.caller, e.type, c.reallocs, e.size, c.final_size, c.max_size, c.moves
               FROM chains c JOIN ev e ON e.file = c.file AND e.row = c.root AND e.alloc
               ORDER BY c.reallocs DESC, c.max_size DESC, c.file, c.root LIMIT {int(top)}"""


def callers_sql(top: int) -> str:
    return f"""
    WITH calls_by AS (
      SELECT caller, count(*) AS calls, count(*) FILTER (WHERE {ALLOCATING}) AS allocs,
             coalesce(sum(size) FILTER (WHERE {ALLOCATING}), 0) AS bytes,
             count(*) FILTER (WHERE type = 'free') AS frees
      FROM trace_rows GROUP BY caller ORDER BY bytes DESC, calls DESC, caller LIMIT {int(top)}),
    leaked AS (SELECT caller, count(*) AS n, sum(size) AS b FROM ev WHERE alloc AND next_alloc IS NULL
               GROUP BY caller)
    SELECT c.caller, c.calls, c.allocs, c.bytes, c.frees, coalesce(l.n, 0), coalesce(l.b, 0)
    FROM calls_by c LEFT JOIN leaked l ON c.caller = l.caller ORDER BY c.bytes DESC, c.calls DESC, c.caller"""


STACK_COUNT = "SELECT count(*) FROM trace_rows WHERE stack IS NOT NULL"


def stacks_sql(top: int) -> str:
    return f"""SELECT stack, count(*), coalesce(sum(size) FILTER (WHERE {ALLOCATING}), 0) AS bytes
               FROM trace_rows WHERE stack IS NOT NULL GROUP BY stack ORDER BY 3 DESC, 2 DESC LIMIT {int(top)}"""


# ---------------------------------------------------------------- the runner (either engine)


def _int(v: Any) -> Any:
    """Spark returns the unsigned 64-bit columns as Decimal: the report's numbers are ints."""
    if isinstance(v, Decimal):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _hex(v: Any) -> str | None:
    return None if v is None else f"{int(v):#x}"


class Report:
    """The report's numbers computed by ENGINE over its view `trace_rows` (trace_rows_sql):
    run() returns the dict of analyze --json's sections (files and settings aside)."""

    def __init__(self, engine: Engine, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> None:
        self.engine = engine
        self.top = top
        self.threshold = mmap_threshold

    def _q(self, sql: str) -> list[tuple]:
        return [tuple(_int(v) for v in r) for r in self.engine.rows(sql)]

    def _one(self, sql: str) -> tuple:
        return self._q(sql)[0]

    def run(self) -> dict:
        rep: dict[str, Any] = {}
        self.engine.materialize("trace_rows", trace_rows_sql(self.engine.source))  # read once
        self._call_mix(rep)
        rep["sizes"] = self._sizes()
        self.engine.materialize("ev", EVENTS)
        rep["lifetimes"] = self._lifetimes()
        rep["live"] = self._live()
        rep["never_freed"] = self._never_freed()
        rep["threads"] = self._threads(rep)
        rep["realloc_chains"] = self._chains()
        rep["callers"] = self._callers()
        rep["stacks"] = self._stacks()
        return rep

    def _call_mix(self, rep: dict) -> None:
        rows = self._q(CALL_MIX)
        events, files, t_first, t_last, untimed, threads = self._one(TOTALS)
        self.timed = events > 0 and untimed == 0
        self.t_first = t_first if self.timed else 0
        rep["totals"] = {
            "events": events,
            "files": files,
            "threads": threads,
            "requested_bytes": sum(r[3] or 0 for r in rows),
            "span_ns": (t_last - t_first) if self.timed else None,
            "free_null": sum(r[4] for r in rows),
        }
        rows.sort(key=lambda r: (-r[1], r[0]))
        rep["calls"] = {name: {"count": n, "failed": f, "requested_bytes": b or 0} for name, n, f, b, _ in rows}

    def _sizes(self) -> dict:
        counts = dict(self._q(SIZE_HISTOGRAM))
        below, below_b, above, above_b, near_below, near_above = self._one(mmap_split_sql(self.threshold))
        return {
            "histogram": [
                {
                    "class": size_class_label(i),
                    "max": SIZE_CLASS_BOUNDS[i] if i < len(SIZE_CLASS_BOUNDS) else None,
                    "count": counts.get(i, 0),
                }
                for i in range(len(SIZE_CLASS_BOUNDS) + 1)
            ],
            "mmap_threshold": {
                "threshold": self.threshold,
                "below": {"count": below, "requested_bytes": below_b},
                "at_or_above": {"count": above, "requested_bytes": above_b},
                "half_to_threshold": near_below,
                "threshold_to_double": near_above,
            },
        }

    def _lifetimes(self) -> dict:
        paired, cross, mn, mx, total, unknown = self._one(LIFETIMES)
        p50 = p90 = p99 = None
        if self.timed and paired:
            p50, p90, p99 = self._one(LIFETIME_PERCENTILES)
        counts = dict(self._q(LIFETIME_HISTOGRAM)) if self.timed else {}
        (over_live,) = self._one(OVER_LIVE)
        timed = self.timed
        return {
            "unit": "ns" if timed else None,
            "freed": paired,
            "cross_thread_frees": cross,
            "min_ns": mn if timed else None,
            "max_ns": mx if timed else None,
            "mean_ns": total / paired if timed and paired else None,
            "p50_ns": p50,
            "p90_ns": p90,
            "p99_ns": p99,
            "histogram": [
                {"class": lifetime_label(i), "count": counts.get(i, 0)} for i in range(len(LIFETIME_BOUNDS) + 1)
            ]
            if timed
            else [],
            "releases_of_unknown_blocks": unknown,
            "allocations_over_live_blocks": over_live,
        }

    def _live(self) -> dict | None:
        n, lo, hi = self._one(LIVE_RANGE)
        if not n:
            return {"unit": None, "peak_bytes": 0, "peak_at": None, "final_bytes": 0, "points": []}
        if not self.timed:
            return None  # an untimed trace (mtrace-text): analyze uses the row position
        self.engine.materialize("live_ev", live_events_sql(lo, hi - lo + 1))
        self.engine.materialize("live_run", LIVE_RUNNING)
        peak, peak_at = self._one(LIVE_PEAK)
        if peak <= 0:
            peak, peak_at = 0, None
        (final,) = self._one(LIVE_FINAL)
        points = [{"bucket": b, "at": at, "max_bytes": mx, "end_bytes": end} for b, at, mx, end in self._q(LIVE_POINTS)]
        return {"unit": "ns", "peak_bytes": peak, "peak_at": peak_at, "final_bytes": final, "points": points}

    def _never_freed(self) -> dict:
        count, total = self._one(NEVER_FREED)
        by_caller = self._q(never_freed_by_caller_sql(self.top))
        return {
            "count": count,
            "requested_bytes": total,
            "by_caller": [{"caller": _hex(c), "count": n, "requested_bytes": s} for c, n, s in by_caller],
        }

    def _threads(self, rep: dict) -> dict:
        rows = self._q(threads_sql(self.top))
        cross = {(f, th): n for f, th, n in self._q(CROSS_BY_THREAD)}
        t0 = self.t_first
        out = [
            {
                "file": f,
                "thread": th,
                "calls": n,
                "allocations": na,
                "frees": nf,
                "requested_bytes": b,
                "first_ns": (lo - t0) if self.timed else None,
                "last_ns": (hi - t0) if self.timed else None,
                "cross_thread_frees": cross.get((f, th), 0),
            }
            for f, th, n, na, nf, b, lo, hi in rows
        ]
        span = rep["totals"]["span_ns"]
        timeline = []
        if self.timed and out:
            grid = {(t["file"], t["thread"]): [0] * THREAD_BUCKETS for t in out}
            for f, th, bucket, n in self._q(timeline_sql(list(grid), t0, span)):
                grid[(f, th)][bucket] = n
            timeline = [{"file": f, "thread": th, "calls": row} for (f, th), row in grid.items()]
        return {
            "count": rep["totals"]["threads"],
            "top": out,
            "timeline": {
                "buckets": THREAD_BUCKETS if timeline else 0,
                "bucket_ns": (span + 1) / THREAD_BUCKETS if timeline else None,
                "threads": timeline,
            },
        }

    def _chains(self) -> dict:
        engine = self.engine
        engine.materialize("links", LINKS)
        engine.materialize("jump_0", JUMP_START)
        rounds = 0
        while True:
            rounds += 1
            engine.materialize(f"jump_{rounds}", jump_round_sql(f"jump_{rounds - 1}"))
            (more,) = self._one(f"SELECT count(*) FROM jump_{rounds} WHERE moved_on")
            if not more:
                break
        reallocs, in_place, moved, released, grew, shrank = self._one(LINK_STATS)
        engine.materialize("chains", chains_sql(f"jump_{rounds}"))
        hist = dict(self._q(CHAIN_HISTOGRAM))
        (count,) = self._one(CHAIN_COUNT)
        labels = CHAIN_LABELS
        return {
            "reallocs_linked": reallocs,
            "in_place": in_place,
            "moved": moved,
            "released": released,
            "grew": grew,
            "shrank": shrank,
            "chains": count,
            "length_histogram": [{"reallocs": labels[i - 1], "chains": hist.get(i, 0)} for i in range(1, 12)],
            "longest": [
                {
                    "file": f,
                    "thread": th,
                    "caller": _hex(c),
                    "first_call": typ,
                    "reallocs": n,
                    "first_size": s0,
                    "final_size": s1,
                    "max_size": smax,
                    "moves": mv,
                }
                for f, th, c, typ, n, s0, s1, smax, mv in self._q(longest_chains_sql(self.top))
            ],
        }

    def _callers(self) -> list[dict]:
        return [
            {
                "caller": _hex(c),
                "calls": n,
                "allocations": na,
                "requested_bytes": b,
                "frees": nf,
                "never_freed": ln,
                "never_freed_bytes": lb,
            }
            for c, n, na, b, nf, ln, lb in self._q(callers_sql(self.top))
        ]

    def _stacks(self) -> dict:
        (with_stack,) = self._one(STACK_COUNT)
        if not with_stack:
            return {"recorded": False, "top": []}
        return {
            "recorded": True,
            "calls_with_stack": with_stack,
            "top": [
                {"stack": [_hex(a) for a in s], "calls": n, "requested_bytes": b}
                for s, n, b in self._q(stacks_sql(self.top))
            ],
        }


# ---------------------------------------------------------------- the two engines


class DuckDBEngine:
    """The report's SQL on DuckDB (a cross-check of analyze; in memory)."""

    def __init__(self, location: str) -> None:
        import duckdb

        self.con = duckdb.connect(":memory:")
        self.source = source_sql("duckdb", location)

    def rows(self, sql: str) -> list[tuple]:
        return self.con.execute(sql).fetchall()

    def materialize(self, name: str, select: str) -> None:
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS {select}")


class SparkEngine:
    """The report's SQL on Spark: SESSION (a SparkSession) reading the dataset at LOCATION
    (a directory, hdfs:// or s3a:// URL). Each materialized step is a local checkpoint (computed
    once, its lineage cut: the pointer-jumping rounds do not recompute the rounds before)."""

    def __init__(self, session: Any, location: str) -> None:  # noqa: ANN401 (pyspark is optional)
        from pyspark.sql import functions

        self.spark = session
        # the file of each row and its row in the file: Spark's hidden _metadata column, which a
        # view does not pass on (so selected here)
        df = session.read.parquet(location)
        df = df.select(
            "*",
            functions.col("_metadata.file_path").alias("pymtrace_file"),
            functions.col("_metadata.row_index").alias("pymtrace_row"),
        )
        df.createOrReplaceTempView("pymtrace_dataset")
        self.source = source_sql("spark", location)

    def rows(self, sql: str) -> list[tuple]:
        return [tuple(r) for r in self.spark.sql(sql).collect()]

    def materialize(self, name: str, select: str) -> None:
        self.spark.sql(select).localCheckpoint(eager=True).createOrReplaceTempView(name)


def spark_report(session: Any, location: str, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> dict:  # noqa: ANN401
    """The report of the dataset at LOCATION computed by Spark (SESSION: a SparkSession)."""
    return Report(SparkEngine(session, location), top, mmap_threshold).run()


def duckdb_report(location: str, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> dict:
    """The report of the dataset directory LOCATION computed by this SQL on DuckDB."""
    return Report(DuckDBEngine(location), top, mmap_threshold).run()


def main(argv: list[str] | None = None) -> int:
    """`spark-submit .../report_sql.py LOCATION` (or `python3 -m pymtrace.trace.report_sql
    --engine duckdb DIR`): the report of the dataset as JSON on stdout (docs/collect.md)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="report_sql", description=main.__doc__)
    parser.add_argument("location", help="the dataset: a directory, or for Spark an hdfs:// or s3a:// URL")
    parser.add_argument("--engine", choices=("spark", "duckdb"), default="spark")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--mmap-threshold", type=int, default=MMAP_THRESHOLD)
    args = parser.parse_args(argv)
    if args.engine == "duckdb":
        rep = duckdb_report(args.location, args.top, args.mmap_threshold)
    else:
        from pyspark.sql import SparkSession

        session = (
            SparkSession.builder.appName("pymtrace-report")
            # Spark's vectorized reader cannot read the unsigned 64-bit columns (docs/collect.md)
            .config("spark.sql.parquet.enableVectorizedReader", "false")
            .getOrCreate()
        )
        try:
            rep = spark_report(session, args.location, args.top, args.mmap_threshold)
        finally:
            session.stop()
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
