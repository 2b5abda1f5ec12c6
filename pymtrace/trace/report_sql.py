"""`pymtrace analyze`'s report: one definition of each section, as SQL over a view `trace_rows`
(file: the recording's index, row: the row in its recording, and the trace columns), run by an
Engine: analyze's DuckDB (trace/analysis.py, TraceSet) or Spark SQL (SparkEngine, the dataset
`pymtrace collect` writes, on a cluster: docs/collect.md).

An Engine runs the statements (`rows`, `materialize`) and does the steps the two engines do
their own way, for their own limits:
- pairing (`pair`): each event with its neighbours at the same address. DuckDB sorts (an
  external sort, in partitions) and numpy pairs the sorted stream, in memory that does not
  grow with the trace; Spark runs window functions (`lag`/`lead` over the address), which it
  distributes (bench/analyze_engines.py: DuckDB's window operator needs a memory limit growing
  with the trace and 1.5-1.9x the CPU);
- the live-bytes curve (`live`): a running sum in time order, streamed the same way (DuckDB) or
  summed per time bucket by windows (Spark);
- the lifetime percentiles (`percentiles`): DuckDB's approx_quantile (a t-digest), Spark's
  exact percentile_disc.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Protocol

from pymtrace.trace import report as R

MMAP_THRESHOLD = 128 * 1024  # glibc's M_MMAP_THRESHOLD default (it grows dynamically up to 32 MiB)
LIVE_BUCKETS = 200  # points of the live-bytes curve
THREAD_BUCKETS = 60  # columns of the per-thread timeline
SIZE_CLASS_BOUNDS = [0] + [1 << k for k in range(4, 26)]  # 0, <=16, <=32, ..., <=32 MiB, then > 32 MiB
LIFETIME_BOUNDS = [10**k for k in range(3, 12)]  # ns: < 1 us, < 10 us, ..., < 100 s, then >= 100 s
CHAIN_BOUNDS = [1 << i for i in range(11)]
# realloc chain lengths: 1, 2-3, 4-7, ..., 512-1023, 1024+ (the report's length_histogram)
CHAIN_LABELS = ["1"] + [f"{1 << (i - 1)}-{(1 << i) - 1}" for i in range(2, 11)] + ["1024+"]


def size_class_label(k: int) -> str:
    """Class K of SIZE_CLASS_BOUNDS: "0", "(0, 16]", ..., "(16 MiB, 32 MiB]", "> 32 MiB"."""
    if k == 0:
        return "0"
    if k == len(SIZE_CLASS_BOUNDS):
        return f"> {_bytes(SIZE_CLASS_BOUNDS[-1])}"
    return f"({_bytes(SIZE_CLASS_BOUNDS[k - 1])}, {_bytes(SIZE_CLASS_BOUNDS[k])}]"


def _bytes(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def lifetime_label(k: int) -> str:
    """Class K of LIFETIME_BOUNDS: "< 1 us", "1 us - 10 us", ..., ">= 100 s"."""
    names = ["1 us", "10 us", "100 us", "1 ms", "10 ms", "100 ms", "1 s", "10 s", "100 s"]
    if k == 0:
        return "< 1 us"
    if k == len(names):
        return ">= 100 s"
    return f"{names[k - 1]} - {names[k]}"


class Engine(Protocol):
    """What the report needs of a SQL engine holding the view `trace_rows`."""

    def rows(self, sql: str) -> list[tuple]: ...

    def materialize(self, name: str, select: str) -> None: ...

    def file_count(self) -> int: ...

    def pair(self, bound: int) -> None:
        """Table `ev`: PAIRED_EVENTS, the rows of EVENTS (at most BOUND) with the NEIGHBOURS
        columns."""

    def percentiles(self) -> tuple:
        """p50, p90, p99 of the lifetimes of the paired releases in `ev`."""

    def live(self, timed: bool) -> R.Live | None:
        """The live-bytes curve of `ev` (TIMED: whether every row has a time)."""


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
    SELECT count(*), min(time_ns) FILTER (WHERE time_ns > 0), max(time_ns),
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
# (release first: seq = 2 row, allocation 2 row + 1). outcome of a realloc's release: 0 in
# place, 1 moved, 2 released (realloc(p, 0) returned NULL).
EVENTS = """
    SELECT file, ptr2 AS ptr, time_ns AS t, row, row * 2 + 1 AS seq, true AS alloc, thread, size, caller,
           type, CAST(NULL AS INT) AS outcome
    FROM trace_rows WHERE ptr2 <> 0 AND type <> 'free' AND (type <> 'posix_memalign' OR ptr1 = 0)
    UNION ALL
    SELECT file, ptr1, time_ns, row, row * 2, false, thread, size, caller, type,
           CASE WHEN type <> 'realloc' THEN NULL WHEN ptr2 = 0 THEN 2 WHEN ptr2 = ptr1 THEN 0 ELSE 1 END
    FROM trace_rows WHERE ptr1 <> 0 AND (type = 'free' OR (type = 'realloc' AND (ptr2 <> 0 OR size = 0)))"""
# The columns Engine.pair adds to each event: of the previous and the next event at the same
# address in time order (by file, ptr, t, seq). As window functions (what Spark runs):
NEIGHBOURS = """
    lag(alloc) OVER w AS prev_alloc, lag(size) OVER w AS prev_size, lag(t) OVER w AS prev_t,
    lag(thread) OVER w AS prev_thread, lag(row) OVER w AS prev_row, lead(alloc) OVER w AS next_alloc"""
PAIRED_EVENTS = f"SELECT e.*, {NEIGHBOURS} FROM ({EVENTS}) e WINDOW w AS (PARTITION BY file, ptr ORDER BY t, seq)"
LIFE = "CAST(t - prev_t AS BIGINT)"
PAIRED_RELEASES = "SELECT * FROM ev WHERE NOT alloc AND prev_alloc"
LIFETIMES = f"""
    SELECT count(*) FILTER (WHERE prev_alloc), count(*) FILTER (WHERE prev_alloc AND thread <> prev_thread),
           min({LIFE}) FILTER (WHERE prev_alloc), max({LIFE}) FILTER (WHERE prev_alloc),
           avg({LIFE}) FILTER (WHERE prev_alloc),
           count(*) FILTER (WHERE prev_alloc IS NULL OR NOT prev_alloc)
    FROM ev WHERE NOT alloc"""
LIFETIME_HISTOGRAM = f"""
    SELECT {case_bucket(LIFE, LIFETIME_BOUNDS, False)} AS k, count(*) FROM ({PAIRED_RELEASES}) p GROUP BY 1"""
OVER_LIVE = "SELECT count(*) FROM ev WHERE alloc AND next_alloc"
NEVER_FREED = "SELECT count(*), coalesce(sum(size), 0) FROM ev WHERE alloc AND next_alloc IS NULL"


def never_freed_by_caller_sql(top: int) -> str:
    return f"""SELECT caller, count(*), sum(size) FROM ev WHERE alloc AND next_alloc IS NULL
               GROUP BY caller ORDER BY 3 DESC, 2 DESC, 1 LIMIT {int(top)}"""


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
    # ties (equal bytes and calls) by the stack itself, element by element: the same rows, in the
    # same order, at every run and on both engines, also at the LIMIT's cut
    return f"""SELECT stack, count(*), coalesce(sum(size) FILTER (WHERE {ALLOCATING}), 0) AS bytes
               FROM trace_rows WHERE stack IS NOT NULL GROUP BY stack ORDER BY 3 DESC, 2 DESC, 1 LIMIT {int(top)}"""


# ---------------------------------------------------------------- the report


def _int(v: Any) -> Any:  # noqa: ANN401
    """Spark returns the unsigned 64-bit columns as Decimal and percentile_disc as a double:
    the report's numbers are ints."""
    if isinstance(v, Decimal):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _hex(v: Any) -> str | None:  # noqa: ANN401
    return None if v is None else f"{int(v):#x}"


def build_report(engine: Engine, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> R.Report:
    """The report of the traces ENGINE holds as `trace_rows` (files, settings and symbols
    aside: what the engine's caller knows of its inputs)."""
    return _Builder(engine, top, mmap_threshold).run()


class _Builder:
    def __init__(self, engine: Engine, top: int, mmap_threshold: int) -> None:
        self.engine = engine
        self.top = top
        self.threshold = mmap_threshold

    def _q(self, sql: str) -> list[tuple]:
        return [tuple(_int(v) for v in r) for r in self.engine.rows(sql)]

    def _one(self, sql: str) -> tuple:
        return self._q(sql)[0]

    def run(self) -> R.Report:
        totals, calls, bound = self._call_mix()
        sizes = self._sizes()
        self.engine.pair(bound)
        return R.Report(
            totals=totals,
            calls=calls,
            sizes=sizes,
            lifetimes=self._lifetimes(),
            live=self.engine.live(self.timed),
            never_freed=self._never_freed(),
            threads=self._threads(totals),
            realloc_chains=self._chains(),
            callers=self._callers(),
            stacks=self._stacks(),
        )

    def _call_mix(self) -> tuple[R.Totals, dict[str, R.CallCount], int]:
        """The totals, the call mix, and how many events the calls make at most (realloc: 2)."""
        rows = self._q(CALL_MIX)
        events, t_first, t_last, untimed, threads = self._one(TOTALS)
        self.timed = events > 0 and untimed == 0
        self.t_first = t_first if self.timed else 0
        totals = R.Totals(
            events=events,
            files=self.engine.file_count(),
            threads=threads,
            requested_bytes=int(sum(r[3] or 0 for r in rows)),
            span_ns=(t_last - t_first) if self.timed else None,
            free_null=int(sum(r[4] for r in rows)),
        )
        rows.sort(key=lambda r: (-r[1], r[0]))
        calls = {name: R.CallCount(count=n, failed=f, requested_bytes=int(b or 0)) for name, n, f, b, _ in rows}
        return totals, calls, events + sum(r[1] for r in rows if r[0] == "realloc")

    def _sizes(self) -> R.Sizes:
        """Request sizes of every allocating call (failed ones too)."""
        counts = dict(self._q(SIZE_HISTOGRAM))
        below, below_b, above, above_b, near_below, near_above = self._one(mmap_split_sql(self.threshold))
        return R.Sizes(
            histogram=[
                R.SizeClass(
                    label=size_class_label(i),
                    max=SIZE_CLASS_BOUNDS[i] if i < len(SIZE_CLASS_BOUNDS) else None,
                    count=counts.get(i, 0),
                )
                for i in range(len(SIZE_CLASS_BOUNDS) + 1)
            ],
            mmap_threshold=R.MmapSplit(
                threshold=self.threshold,
                below=R.Requests(count=below, requested_bytes=int(below_b)),
                at_or_above=R.Requests(count=above, requested_bytes=int(above_b)),
                half_to_threshold=near_below,
                threshold_to_double=near_above,
            ),
        )

    def _lifetimes(self) -> R.Lifetimes:
        paired, cross, mn, mx, mean, unknown = self._one(LIFETIMES)
        timed = self.timed
        p50 = p90 = p99 = None
        if timed and paired:
            p50, p90, p99 = (_int(p) for p in self.engine.percentiles())
        counts = dict(self._q(LIFETIME_HISTOGRAM)) if timed else {}
        (over_live,) = self._one(OVER_LIVE)
        return R.Lifetimes(
            unit="ns" if timed else None,
            freed=paired,
            cross_thread_frees=cross,
            min_ns=mn if timed else None,
            max_ns=mx if timed else None,
            mean_ns=float(mean) if timed and mean is not None else None,
            p50_ns=p50,
            p90_ns=p90,
            p99_ns=p99,
            histogram=[
                R.LifetimeClass(label=lifetime_label(i), count=counts.get(i, 0))
                for i in range(len(LIFETIME_BOUNDS) + 1)
            ]
            if timed
            else [],
            releases_of_unknown_blocks=unknown,
            allocations_over_live_blocks=over_live,
        )

    def _never_freed(self) -> R.NeverFreed:
        count, total = self._one(NEVER_FREED)
        return R.NeverFreed(
            count=count,
            requested_bytes=int(total),
            by_caller=[
                R.NeverFreedCaller(caller=_hex(c), count=n, requested_bytes=int(s))
                for c, n, s in self._q(never_freed_by_caller_sql(self.top))
            ],
        )

    def _threads(self, totals: R.Totals) -> R.Threads:
        rows = self._q(threads_sql(self.top))
        cross = {(f, th): n for f, th, n in self._q(CROSS_BY_THREAD)}
        t0 = self.t_first
        top = [
            R.ThreadStats(
                file=f,
                thread=th,
                calls=n,
                allocations=na,
                frees=nf,
                requested_bytes=int(b),
                first_ns=(lo - t0) if self.timed else None,
                last_ns=(hi - t0) if self.timed else None,
                cross_thread_frees=cross.get((f, th), 0),
            )
            for f, th, n, na, nf, b, lo, hi in rows
        ]
        span = totals.span_ns
        timeline = []
        if self.timed and top:
            grid = {(t.file, t.thread): [0] * THREAD_BUCKETS for t in top}
            for f, th, bucket, n in self._q(timeline_sql(list(grid), t0, span)):
                grid[(f, th)][bucket] = n
            timeline = [R.ThreadTimeline(file=f, thread=th, calls=row) for (f, th), row in grid.items()]
        return R.Threads(
            count=totals.threads,
            top=top,
            timeline=R.Timeline(
                buckets=THREAD_BUCKETS if timeline else 0,
                bucket_ns=(span + 1) / THREAD_BUCKETS if timeline else None,
                threads=timeline,
            ),
        )

    def _chains(self) -> R.ReallocChains:
        """Realloc growth chains: a block followed through the reallocs that moved or resized it."""
        engine = self.engine
        engine.materialize("links", LINKS)
        # each round's table made from the previous one, in two tables by turns: two at a time
        previous, current = "jump_b", "jump_a"
        engine.materialize(current, JUMP_START)
        while True:
            previous, current = current, previous
            engine.materialize(current, jump_round_sql(previous))
            (more,) = self._one(f"SELECT count(*) FROM {current} WHERE moved_on")
            if not more:
                break
        reallocs, in_place, moved, released, grew, shrank = self._one(LINK_STATS)
        engine.materialize("chains", chains_sql(current))
        hist = dict(self._q(CHAIN_HISTOGRAM))
        (count,) = self._one(CHAIN_COUNT)
        return R.ReallocChains(
            reallocs_linked=reallocs,
            in_place=in_place,
            moved=moved,
            released=released,
            grew=grew,
            shrank=shrank,
            chains=count,
            length_histogram=[R.ChainLength(reallocs=CHAIN_LABELS[i - 1], chains=hist.get(i, 0)) for i in range(1, 12)],
            longest=[
                R.Chain(
                    file=f,
                    thread=th,
                    caller=_hex(c),
                    first_call=typ,
                    reallocs=n,
                    first_size=int(s0),
                    final_size=int(s1),
                    max_size=int(smax),
                    moves=mv,
                )
                for f, th, c, typ, n, s0, s1, smax, mv in self._q(longest_chains_sql(self.top))
            ],
        )

    def _callers(self) -> list[R.Caller]:
        return [
            R.Caller(
                caller=_hex(c),
                calls=n,
                allocations=na,
                requested_bytes=int(b),
                frees=nf,
                never_freed=int(ln),
                never_freed_bytes=int(lb),
            )
            for c, n, na, b, nf, ln, lb in self._q(callers_sql(self.top))
        ]

    def _stacks(self) -> R.Stacks:
        (with_stack,) = self._one(STACK_COUNT)
        if not with_stack:
            return R.Stacks(recorded=False, top=[])
        return R.Stacks(
            recorded=True,
            calls_with_stack=with_stack,
            top=[
                R.Stack(stack=[_hex(a) for a in s], calls=n, requested_bytes=int(b))
                for s, n, b in self._q(stacks_sql(self.top))
            ],
        )


# ---------------------------------------------------------------- Spark

# a part written by `pymtrace collect`: its stream (one recording) and its first row's offset
PART_PATTERN = "part-([0-9a-f]{32})-([0-9]{12})[.]parquet$"


def trace_rows_sql(source: str) -> str:
    """The view the report reads, from SOURCE (a SELECT of the dataset with `path`, the file,
    and `idx`, the row in the file): the parts `collect` wrote of one stream are one recording,
    rows counted from each part's first offset (from its name); recordings numbered 0, 1, ...
    in the order of their first file's path (as analyze does)."""
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


# The live bytes, distributed: each event's change and its time bucket, then the running sum
# of each bucket's events in order plus the sum of every earlier bucket (a window over the few
# bucket totals).
def live_events_sql(lo: int, span: int) -> str:
    """Each event's change of the live requested bytes and its bucket of the curve; x: its
    time from the first event, as analyze's DuckDB engine computes it (float64(t) - float64(lo))."""
    x = f"(CAST(t AS DOUBLE) - CAST({int(lo)} AS DOUBLE))"
    return f"""
    SELECT file, seq, t, {x} AS x,
           CAST(least({LIVE_BUCKETS - 1}, floor({x} * {LIVE_BUCKETS} / {int(span)})) AS INT) AS b,
           CASE WHEN alloc THEN CAST(size AS BIGINT) WHEN prev_alloc THEN -CAST(prev_size AS BIGINT) ELSE 0 END AS d
    FROM ev"""


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
LIVE_RANGE = "SELECT count(*), min(t), max(t) FROM ev"
# exact, where analyze's DuckDB gives approximate ones (a t-digest: it keeps no sort of every lifetime)
LIFETIME_PERCENTILES = f"""
    SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY {LIFE}), percentile_disc(0.9) WITHIN GROUP (ORDER BY {LIFE}),
           percentile_disc(0.99) WITHIN GROUP (ORDER BY {LIFE})
    FROM ({PAIRED_RELEASES}) p"""


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
        source = (
            "SELECT thread, CAST(type AS STRING) AS type, ptr1, ptr2, size, time_ns, caller, stack, "
            "pymtrace_file AS path, pymtrace_row AS idx FROM pymtrace_dataset"
        )
        self.materialize("trace_rows", trace_rows_sql(source))  # read once

    def rows(self, sql: str) -> list[tuple]:
        return [tuple(r) for r in self.spark.sql(sql).collect()]

    def materialize(self, name: str, select: str) -> None:
        self.spark.sql(select).localCheckpoint(eager=True).createOrReplaceTempView(name)

    def file_count(self) -> int:
        return self.rows("SELECT count(DISTINCT path) FROM trace_rows")[0][0]

    def pair(self, bound: int) -> None:
        self.materialize("ev", PAIRED_EVENTS)

    def percentiles(self) -> tuple:
        return self.rows(LIFETIME_PERCENTILES)[0]

    def live(self, timed: bool) -> R.Live | None:
        n, lo, hi = (_int(v) for v in self.rows(LIVE_RANGE)[0])
        if not n:
            return R.Live(unit=None, peak_bytes=0, peak_at=None, final_bytes=0, points=[])
        if not timed:
            return None  # a dataset without times; analyze's DuckDB engine uses the row position
        self.materialize("live_ev", live_events_sql(lo, hi - lo + 1))
        self.materialize("live_run", LIVE_RUNNING)
        peak, peak_at = (_int(v) for v in self.rows(LIVE_PEAK)[0])
        if peak <= 0:
            peak, peak_at = 0, None
        (final,) = (_int(v) for v in self.rows(LIVE_FINAL)[0])
        points = [
            R.LivePoint(bucket=b, at=at, max_bytes=mx, end_bytes=end)
            for b, at, mx, end in ((_int(v) for v in r) for r in self.rows(LIVE_POINTS))
        ]
        return R.Live(unit="ns", peak_bytes=peak, peak_at=peak_at, final_bytes=final, points=points)


def spark_report(session: Any, location: str, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> R.Report:  # noqa: ANN401
    """The report of the dataset at LOCATION (a `pymtrace collect` directory, or an hdfs:// or
    s3a:// URL of one) computed by Spark (SESSION: a SparkSession); its to_json() is the dict
    `analyze --json` prints for that dataset, without files, settings and symbols and with
    exact lifetime percentiles."""
    return build_report(SparkEngine(session, location), top, mmap_threshold)
