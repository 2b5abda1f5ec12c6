"""`pymtrace analyze`'s inputs and DuckDB, embedded: the engine that runs the report's SQL
(trace/report_sql.py) over one or many traces, and the user's --sql (docs/analyze.md).

TraceSet gathers the inputs (Parquet files as they are; mtrace-bin and mtrace-text converted to
private temporary Parquet files) in a private directory (mkdtemp, 0700) that also holds
DuckDB's spill directory, all removed at close. DuckDB runs under a memory limit and spills to
that directory, so traces larger than RAM are analyzed in bounded memory. report() returns the
typed report (trace/report.py: what --json prints and the text and HTML reports draw); query()
runs a user's SQL over a view `calls` on a connection that can read the traces and nothing else
and write no file.

Pairing (report_sql.EVENTS splits the calls into events): the events of one address in one
file, in time order (time_ns, then row, then the release before the allocation), pair each
allocation with the release after it; DuckDB sorts them and numpy pairs the sorted stream
(TraceSet.pair), in memory that does not grow with the trace. That gives lifetimes,
cross-thread frees, never-freed blocks, live requested bytes over time and realloc chains.
"""

from __future__ import annotations

import glob
import os
import resource
import shutil
import tempfile
from typing import Any, Sequence

import duckdb
import pyarrow.compute

from pymtrace.errors import BadQuery, CorruptFile, PymtraceError
from pymtrace.trace import mappings
from pymtrace.trace import report as R
from pymtrace.trace.formats import parquet
from pymtrace.trace.formats.autodetect import detect_format, recorded_allocator
from pymtrace.trace.report_sql import EVENTS, LIVE_BUCKETS, MMAP_THRESHOLD, build_report

DEFAULT_MEMORY_LIMIT = "1GB"
# Under an address-space limit (RLIMIT_AS): what one more DuckDB worker thread maps (its stack,
# RLIMIT_STACK, and the 64 MiB glibc reserves for the malloc arena of a thread that allocates),
# and the least memory limit the report runs in (DuckDB's fixed part is ~20 MB)
THREAD_ARENA = 64 << 20
MIN_MEMORY_LIMIT = 32 << 20
SORT_BYTES_PER_EVENT = 16  # of the memory limit per DuckDB thread, per event in one sort (TraceSet.sort_events)
COLUMNS = ("thread", "type", "ptr1", "ptr2", "size", "size2", "size3", "time_ns", "caller", "path", "stack")
# DuckDB's errors about the SQL itself (a defect of the report, shown as is); every other error
# while reading the inputs is a damaged file
_DUCKDB_OWN_ERRORS = (duckdb.BinderException, duckdb.CatalogException, duckdb.ParserException)


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by PATTERNS: a file, a glob (`'traces/*.parquet'`, expanded here when the
    shell did not) or a directory (its *.parquet files, in subdirectories too: a `pymtrace
    collect` dataset); each file once, in order."""
    out: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(glob.glob(os.path.join(glob.escape(pattern), "**", "*.parquet"), recursive=True))
            if not found:
                raise PymtraceError(f"{pattern}: a directory without *.parquet files")
        elif os.path.lexists(pattern) or not glob.has_magic(pattern):
            found = [pattern]
        else:
            found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not found:
                raise PymtraceError(f"{pattern}: no file matches")
        for path in found:
            if os.path.abspath(path) not in (os.path.abspath(p) for p in out):
                out.append(path)
    return out


def _allocator_of(path: str, fmt: str) -> str | None:
    """The allocator family trace PATH (of format FMT) was recorded from: "glibc", "jemalloc",
    ..., or None when the format cannot say (mtrace-text, a workload)."""
    if fmt not in ("mtrace-bin", "parquet"):
        return None
    return recorded_allocator(path) or "glibc"


class TraceSet:
    """The traces PATHS (patterns as expand_inputs) opened for analysis; use as a context manager.

    MEMORY_LIMIT is DuckDB's (e.g. "1GB"), THREADS its worker threads (None: one per CPU),
    TEMP_DIR where the private working directory goes (None: $TMPDIR or /tmp); it holds
    converted inputs and what DuckDB spills, and is removed at close(). SORT_EVENTS: the most
    events one DuckDB sort is given (None: from the memory limit, see sort_events()); more
    events sort in partitions. Setting it makes a small trace sort in partitions (the tests:
    the limit's own value needs millions of events, and the memory limit cannot go below
    DuckDB's fixed ~20 MB).
    """

    def __init__(
        self,
        paths: Sequence[str],
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        threads: int | None = None,
        temp_dir: str | None = None,
        sort_events: int | None = None,
    ) -> None:
        self.inputs = expand_inputs(paths)
        self.memory_limit = memory_limit
        self.max_sort_events = sort_events
        self.threads = threads
        try:
            self.workdir = tempfile.mkdtemp(prefix="pymtrace-analyze.", dir=temp_dir)
        except OSError as exc:
            raise PymtraceError(f"cannot create a temporary directory: {exc.strerror}") from None
        self.spill_dir = os.path.join(self.workdir, "spill")
        self.con: duckdb.DuckDBPyConnection | None = None
        self.events_file: str | None = None  # the paired events (report(): _pair)
        try:
            self.formats = []
            self.files = [self._parquet_of(p) for p in self.inputs]
            self.recording = self._recordings()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TraceSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close DuckDB and remove the private directory (converted inputs, spill)."""
        if self.con is not None:
            self.con.close()
            self.con = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _parquet_of(self, path: str) -> str:
        """PATH itself if it is Parquet (checked), else a private temporary Parquet copy."""
        fmt = detect_format(path)
        self.formats.append(fmt)
        if fmt == "parquet":
            parquet.open_file(path)  # CorruptFile (one line) on a truncated or foreign file
            return os.path.abspath(path)
        fd, tmp = tempfile.mkstemp(prefix="input.", suffix=".parquet", dir=self.workdir)  # 0600
        with os.fdopen(fd, "wb") as out:
            parquet.convert_to_parquet(path, fmt, out)
        return tmp

    def _recordings(self) -> list[int]:
        """For each file, the index of the recording it belongs to: the parts `pymtrace
        collect` wrote of one stream (pymtrace.stream) are one recording, so a block allocated
        in one part and freed in a later one is paired; any other file is a recording alone."""
        index: dict[str, int] = {}
        out = []
        self.row_base = []  # a part's first row in its recording: rows count across its parts
        for i, path in enumerate(self.files):
            meta = parquet.read_metadata(path) if self.formats[i] == "parquet" else {}
            stream = meta.get("stream")
            key = f"stream:{stream}" if stream else f"file:{i}"
            out.append(index.setdefault(key, len(index)))
            base = meta.get("first_offset", "0") if stream else "0"
            self.row_base.append(int(base) if base.isdigit() else 0)
        return out

    def _config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "memory_limit": self.memory_limit,
            "temp_directory": self.spill_dir,
            "preserve_insertion_order": False,
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
        }
        if self.threads:
            config["threads"] = self.threads
        return config

    def _connect(self, database: str) -> duckdb.DuckDBPyConnection:
        config = self._config()
        left = address_space_left()
        if left is not None:
            config.update(_fitted_threads(left, self.threads or os.cpu_count() or 1))
        try:
            try:
                con = duckdb.connect(database, config=config)
            except duckdb.InvalidInputException as exc:
                if "async_threads" not in str(exc):
                    raise
                del config["async_threads"]  # a DuckDB before 2.0: no such threads
                con = duckdb.connect(database, config=config)
            con.execute("SET enable_progress_bar = false")  # a session setting: not in config
            if left is not None:
                self._fit_memory_limit(con, left, config["threads"])
            return con
        except duckdb.Error as exc:
            raise PymtraceError(f"cannot start DuckDB: {_first_line(exc)}") from None

    def _fit_memory_limit(self, con: duckdb.DuckDBPyConnection, left: int, threads: int) -> None:
        """Under an address-space limit that left LEFT bytes before DuckDB started: DuckDB's
        memory limit is at most half of what its THREADS' stacks and arenas leave of it (the
        other half: Python, pyarrow's and numpy's buffers, DuckDB's own allocations beyond its
        buffers); PymtraceError when that is too little for the report."""
        (current,) = con.execute("SELECT current_setting('memory_limit')").fetchall()[0]
        fitted = min(_size_bytes(str(current)), (left - (threads - 1) * _thread_bytes()) // 2)
        if fitted < MIN_MEMORY_LIMIT:
            con.close()
            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            raise PymtraceError(
                f"the address-space limit (ulimit -v: {soft >> 20} MiB) leaves {max(left, 0) >> 20} MiB, too "
                f"little for DuckDB (it needs about {2 * MIN_MEMORY_LIMIT >> 20} MiB); raise the limit"
            )
        if fitted < _size_bytes(str(current)):
            con.execute(f"SET memory_limit = '{fitted >> 10}KiB'")
            self.memory_limit = f"{fitted >> 20}MiB"

    def _select_list(self, path: str, source: str, index: int, with_row: bool, row_base: int = 0) -> str:
        """SELECT of the schema's columns from SOURCE, cast to the types pymtrace writes (a file
        rewritten by another tool may have signed columns or lack path/stack)."""
        names = parquet.open_file(path).schema_arrow.names
        cols = [f"{index} AS file"]
        casts = {"thread": "INTEGER", "type": "VARCHAR", "path": "USMALLINT", "stack": "UBIGINT[]"}
        for c in COLUMNS:
            typ = casts.get(c, "UBIGINT")
            cols.append(f"CAST({c} AS {typ}) AS {c}" if c in names else f"CAST(NULL AS {typ}) AS {c}")
        if with_row:
            cols.append(f"file_row_number + {int(row_base)} AS row")
        return f"SELECT {', '.join(cols)} FROM {source}"

    # ---------------------------------------------------------------- user SQL

    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        """(column names, rows) of the user's SQL over the view `calls` (the trace columns plus
        `file`, the input's index). The traces are read through pyarrow datasets registered with
        DuckDB, then DuckDB's file system access is switched off and its configuration locked:
        the query can read the traces and nothing else, write no file, load no extension.
        BadQuery (exit 2) for any error in the query."""
        import pyarrow.dataset

        con = self.con = self._connect(":memory:")
        selects = []
        for i, path in enumerate(self.files):
            con.register(f"pymtrace_input_{i}", pyarrow.dataset.dataset(path, format="parquet"))
            selects.append(self._select_list(path, f"pymtrace_input_{i}", self.recording[i], with_row=False))
        con.execute("CREATE VIEW calls AS " + " UNION ALL ".join(selects))
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        try:
            rel = con.sql(sql)
            if rel is None:
                return [], []
            return list(rel.columns), rel.fetchall()
        except duckdb.Error as exc:
            raise BadQuery(f"query failed: {_first_line(exc)}") from None

    # ---------------------------------------------------------------- the report

    def report(self, top: int = 10, mmap_threshold: int = MMAP_THRESHOLD) -> R.Report:
        """Every number of the analysis (docs/analyze.md lists them; to_json() is --json's dict)."""
        # an in-memory database: its tables are evicted to the spill directory beyond the memory
        # limit like any other DuckDB buffer (an on-disk database costs compression and checkpoints)
        self.con = self._connect(":memory:")
        try:
            self._check_nulls()
            return self._report(top, mmap_threshold)
        except duckdb.OutOfMemoryException as exc:
            raise PymtraceError(
                f"DuckDB ran out of memory ({_first_line(exc)}); raise --memory-limit or lower --threads"
            ) from None
        except _DUCKDB_OWN_ERRORS:
            raise  # the report's SQL, not the data
        except (duckdb.Error, pyarrow.ArrowException) as exc:
            # damaged pages or a damaged footer that still parsed: DuckDB's Thrift and page
            # decoders fail in many ways (TProtocolException, "Out of buffer", ...)
            raise CorruptFile(f"{self._damaged()}: cannot read the trace: {_first_line(exc)}") from None
        except OSError as exc:  # DuckDB's errors inside a streamed result reach pyarrow's reader as OSError
            if "Out of Memory" in str(exc):
                raise PymtraceError(
                    f"DuckDB ran out of memory ({_first_line(exc)}); raise --memory-limit or lower --threads"
                ) from None
            raise CorruptFile(f"{self._damaged()}: cannot read the trace: {_first_line(exc)}") from None

    def _check_nulls(self) -> None:
        """CorruptFile for a NULL in a column the report reads: pymtrace writes none (the schema
        has them required), another tool's file may declare them optional and hold some."""
        for i, path in enumerate(self.files):
            schema = parquet.open_file(path).schema_arrow
            optional = [c for c in COLUMNS if c != "stack" and c in schema.names and schema.field(c).nullable]
            if not optional:
                continue
            counts = self._one(
                "SELECT "
                + ", ".join(f"count(*) FILTER (WHERE {c} IS NULL)" for c in optional)
                + f" FROM read_parquet('{path.replace(chr(39), chr(39) * 2)}')"
            )
            for column, n in zip(optional, counts):
                if n:
                    raise CorruptFile(f"{self.inputs[i]}: {n} NULL in column {column} (a trace has none)")

    def _damaged(self) -> str:
        """The input(s) DuckDB cannot read: each file is read whole on its own, the first that
        fails is named (all of them when none fails alone)."""
        if len(self.files) == 1:
            return self.inputs[0]
        for i, path in enumerate(self.files):
            try:
                select = self._select_list(path, f"read_parquet('{path.replace(chr(39), chr(39) * 2)}')", 0, False)
                self.con.execute(f"SELECT min(COLUMNS(*)) FROM ({select})").fetchall()
            except (duckdb.Error, pyarrow.ArrowException, OSError):
                return self.inputs[i]
        return ", ".join(self.inputs)

    def spilled_bytes(self) -> int:
        """Bytes of working data held on disk rather than in memory now (0 before report()):
        what DuckDB spilled, plus the paired events, which analyze keeps in a private file."""
        if self.con is None:
            return 0
        (spilled,) = self._one("SELECT coalesce(sum(temporary_storage_bytes), 0) FROM duckdb_memory()")
        events = os.path.getsize(self.events_file) if self.events_file else 0
        return int(spilled) + events

    def _one(self, sql: str) -> tuple:
        return self.con.execute(sql).fetchall()[0]

    def _report(self, top: int, mmap_threshold: int) -> R.Report:
        selects = [
            self._select_list(
                p,
                f"read_parquet('{p.replace(chr(39), chr(39) * 2)}', file_row_number = true)",
                self.recording[i],
                True,
                self.row_base[i],
            )
            for i, p in enumerate(self.files)
        ]
        self.con.execute("CREATE VIEW trace_rows AS " + " UNION ALL ".join(selects))
        rep = build_report(self, top, mmap_threshold)
        rep.files = [
            R.InputFile(path=p, format=f, allocator=_allocator_of(p, f)) for p, f in zip(self.inputs, self.formats)
        ]
        rep.settings = R.Settings(memory_limit=self.memory_limit, mmap_threshold=mmap_threshold, top=top)
        # the allocators the traces say they were recorded from (None: not said, e.g. a text log)
        rep.totals.allocators = sorted({f.allocator for f in rep.files if f.allocator})
        rep.symbols = self._symbolize(rep, top)
        return rep

    # ---------------------------------------------------------------- report_sql.Engine

    def rows(self, sql: str) -> list[tuple]:
        return self.con.execute(sql).fetchall()

    def materialize(self, name: str, select: str) -> None:
        self.con.execute(f"CREATE OR REPLACE TABLE {name} AS {select}")

    def file_count(self) -> int:
        return len(self.files)

    def percentiles(self) -> tuple:
        return self._one(
            """SELECT approx_quantile(t - prev_t, 0.5) FILTER (WHERE prev_alloc),
                      approx_quantile(t - prev_t, 0.9) FILTER (WHERE prev_alloc),
                      approx_quantile(t - prev_t, 0.99) FILTER (WHERE prev_alloc)
               FROM ev WHERE NOT alloc"""
        )

    def _stack_tables(self) -> dict[int, dict]:
        """The stack table (FILE.stacks) of each input recorded with `record --stacks` and
        still beside it: file index -> {stack id: stacktable.Stack}."""
        from pymtrace.trace import stacktable

        tables = {}
        for i, path in enumerate(self.files):
            if self.formats[i] != "parquet" or not parquet.has_stacks(path):
                continue
            table_path = stacktable.table_path(self.inputs[i])
            if os.path.isfile(table_path):
                tables[i] = stacktable.read_table(table_path)
        return tables

    def _symbolize(self, rep: R.Report, top: int) -> R.Symbols:
        """Function, file and line of the callers in REP: from the stack tables (a caller
        address is in the allocating, innermost, frame of the stacks of its calls), else from
        the executable mappings the traces keep (trace/mappings.py) and the files they name,
        found on this machine. A trace without either keeps its callers as addresses
        (docs/analyze.md, "Callers")."""
        tables = self._stack_tables()
        recorded = self._recorded_maps()
        if not tables and not recorded:
            return R.Symbols(source=None, callers_symbolized=0)
        leaf: dict[int, Any] = {}
        for i, table in tables.items():
            for caller, stack_id in self.rows(
                f"""SELECT caller, any_value(stack_id) FROM read_parquet('{self.files[i].replace(chr(39), chr(39) * 2)}')
                    WHERE stack_id > 0 GROUP BY caller"""
            ):
                stack = table.get(int(stack_id))
                if stack is not None and stack.frames and caller not in leaf:
                    f = stack.frames[-1]
                    leaf[caller] = (f.function, f"{f.file}:{f.line}" if f.file else None)
        symbolizer = mappings.Symbolizer()
        entries = [*rep.callers, *rep.never_freed.by_caller, *rep.realloc_chains.longest]
        done = set()
        for entry in entries:
            addr = int(entry.caller, 16) if entry.caller else 0
            found = leaf.get(addr)
            if found is None and addr:
                found = self._place(symbolizer, recorded, addr, getattr(entry, "file", None))
            entry.function, entry.source = found or (None, None)
            if found:
                done.add(entry.caller)
        if tables and not rep.stacks.recorded:
            rep.stacks = self._table_stacks(tables, top)
        source = "stack table" if tables and not recorded else "maps" if not tables else "stack table, maps"
        symbols = R.Symbols(source=source, callers_symbolized=len(done))
        if recorded:
            symbols.files_missing = sorted(symbolizer.missing)
        return symbols

    def _recorded_maps(self) -> dict[int, mappings.Maps]:
        """The executable mappings each input keeps (file index -> Maps), for those that have them."""
        out = {}
        for i, path in enumerate(self.files):
            meta = parquet.read_metadata(path) if self.formats[i] == "parquet" else None
            found = mappings.load(self.inputs[i], self.formats[i], meta)
            if found is not None:
                out[i] = found
        return out

    @staticmethod
    def _place(
        symbolizer: mappings.Symbolizer, recorded: dict[int, mappings.Maps], addr: int, file: int | None
    ) -> tuple[str, str | None] | None:
        """(function, file:line) of caller ADDR from the maps of input FILE (None: of the first
        input whose maps hold it)."""
        for i, maps in recorded.items():
            if file is not None and i != file:
                continue
            place = symbolizer.place(maps, i, addr)
            if place is not None:
                return place.function, f"{place.file}:{place.line}" if place.file else None
        return None

    def _table_stacks(self, tables: dict[int, dict], top: int) -> R.Stacks:
        """The top stacks by requested bytes of `record --stacks` recordings (stack ids, the
        frames from the stack tables), innermost frame first like the `stack` column's."""
        rows = []
        for i in tables:
            rows += [
                (i, *r)
                for r in self.rows(
                    f"""SELECT stack_id, count(*), coalesce(sum(size), 0) AS bytes
                        FROM read_parquet('{self.files[i].replace(chr(39), chr(39) * 2)}')
                        WHERE stack_id > 0 GROUP BY stack_id ORDER BY 3 DESC, 2 DESC, 1 LIMIT {int(top)}"""
                )
            ]
        rows.sort(key=lambda r: (-r[3], -r[2], r[0], r[1]))
        out = []
        for i, stack_id, n, nbytes in rows[:top]:
            stack = tables[i].get(int(stack_id))
            frames = reversed(stack.frames) if stack is not None else []
            out.append(
                R.Stack(
                    file=i,
                    stack_id=int(stack_id),
                    stack=[f"{f.function}({f.file}:{f.line})" if f.file else f.function for f in frames],
                    calls=n,
                    requested_bytes=int(nbytes),
                )
            )
        with_stack = sum(
            self._one(
                f"SELECT count(*) FROM read_parquet('{self.files[i].replace(chr(39), chr(39) * 2)}') WHERE stack_id > 0"
            )[0]
            for i in tables
        )
        return R.Stacks(recorded=True, source="stack table", calls_with_stack=with_stack, top=out)

    def sort_events(self) -> int:
        """How many events one DuckDB sort may hold under the memory limit (or the sort_events
        given). DuckDB's external sort needs memory growing with its input (it merges its
        spilled runs with a block of each pinned: 10M events did not sort in 64 MB, 2.5M did,
        2 threads), so analyze sorts partitions of at most this many events:
        SORT_BYTES_PER_EVENT of the limit per thread."""
        if self.max_sort_events is not None:
            return max(1, self.max_sort_events)
        limit, threads = self._one("SELECT current_setting('memory_limit'), current_setting('threads')")
        return max(1 << 16, _size_bytes(str(limit)) // (SORT_BYTES_PER_EVENT * max(1, int(threads))))

    def partitions(self) -> int:
        """Into how many partitions the events are sorted (see sort_events)."""
        return max(1, -(-self.max_events // self.sort_events()))

    def pair(self, bound: int) -> None:
        """Table `ev`: the events (report_sql.EVENTS, at most BOUND) with their neighbours at
        the same address (report_sql.NEIGHBOURS).

        DuckDB sorts the events by (file, address, time, row) — an external sort, spilling
        beyond the memory limit — and streams them in batches; numpy takes each event's previous
        and next event at the same address, and the batches go back into `ev` through a second
        cursor. (DuckDB's window operator, report_sql.PAIRED_EVENTS as Spark runs it, needs a
        memory limit growing with the trace and 1.5-1.9x the CPU: bench/analyze_engines.py.)"""
        import numpy
        import pyarrow
        import pyarrow.parquet

        con = self.con
        ev_schema = """(file INTEGER, ptr UBIGINT, t UBIGINT, row BIGINT, seq BIGINT, alloc BOOLEAN,
                 thread INTEGER, size UBIGINT, caller UBIGINT, type VARCHAR, outcome UTINYINT,
                 prev_alloc BOOLEAN, prev_size UBIGINT, prev_t UBIGINT, prev_thread INTEGER, prev_row BIGINT,
                 next_alloc BOOLEAN)"""
        self.max_events = bound
        parts = self.partitions()
        batch_rows = 1 << 18

        def batches() -> Any:
            """The events of every address partition in turn, each sorted: partitions hold
            different addresses, so their concatenation pairs like one sort would."""
            for k in range(parts):
                where = f"WHERE hash(file, ptr) % {parts} = {k} " if parts > 1 else ""
                sql = f"SELECT * FROM ({EVENTS}) e {where}ORDER BY file, ptr, t, seq"
                rel = con.sql(sql)
                yield from (
                    rel.to_arrow_reader(batch_rows)
                    if hasattr(rel, "to_arrow_reader")
                    else rel.fetch_record_batch(batch_rows)
                )

        reader = batches()
        # the paired events go to a private Parquet file, not a DuckDB table: an in-memory table
        # kept ~40-60 MB resident beyond what it spilled and starved the sorts (64 MB, 10M events)
        fd, ev_path = tempfile.mkstemp(prefix="events.", suffix=".parquet", dir=self.workdir)  # 0600
        self.events_file = ev_path
        sink = os.fdopen(fd, "wb")
        writer = None
        sentinel = None
        context = None  # the last two rows seen: the first still lacks its successor

        def emit(x: pyarrow.Table) -> None:
            """Rows 1..n-2 of X, each with its neighbours at the same address (rows 0 and n-1 are context)."""
            f = x.column("file").to_numpy()
            p = x.column("ptr").to_numpy()
            same = (f[1:] == f[:-1]) & (p[1:] == p[:-1])  # row i+1 continues row i's address
            has_prev, has_next = same[:-1], same[1:]
            mid = x.slice(1, x.num_rows - 2)

            def neighbour(col: str, lo: int, mask: numpy.ndarray) -> pyarrow.Array:
                values = x.column(col).slice(lo, x.num_rows - 2).combine_chunks()
                return pyarrow.compute.if_else(pyarrow.array(mask), values, pyarrow.nulls(len(values), values.type))

            out = mid
            for name, col in (("prev_alloc", "alloc"), ("prev_size", "size"), ("prev_t", "t")):
                out = out.append_column(name, neighbour(col, 0, has_prev))
            out = out.append_column("prev_thread", neighbour("thread", 0, has_prev))
            out = out.append_column("prev_row", neighbour("row", 0, has_prev))
            out = out.append_column("next_alloc", neighbour("alloc", 2, has_next))
            nonlocal writer
            if writer is None:
                writer = pyarrow.parquet.ParquetWriter(sink, out.schema, compression="lz4")
            writer.write_table(out.cast(writer.schema))

        for batch in reader:
            if not batch.num_rows:
                continue
            table = pyarrow.Table.from_batches([batch])
            if sentinel is None:
                row = {name: None for name in table.schema.names}
                row.update(file=-1, ptr=0, alloc=False)
                sentinel = pyarrow.Table.from_pylist([row], schema=table.schema)
                context = sentinel
            x = pyarrow.concat_tables([context, table])
            if x.num_rows > 2:
                emit(x)
            context = x.slice(x.num_rows - 2)
        if context is not None and context.num_rows == 2:
            emit(pyarrow.concat_tables([context, sentinel]))
        if writer is None:  # no events
            con.execute("CREATE TABLE ev " + ev_schema)
        else:
            writer.close()
            sink.close()
            con.execute(f"CREATE VIEW ev AS SELECT * FROM read_parquet('{ev_path.replace(chr(39), chr(39) * 2)}')")
        sink.close()

    def live(self, timed: bool) -> R.Live:
        """Live requested bytes (allocated, not yet freed: the ideal RSS) over time, its exact peak.
        DuckDB sorts the events (spilling beyond the memory limit) and streams their byte changes
        in batches; numpy keeps the running sum, the peak and, per bucket of the timeline
        (LIVE_BUCKETS), the highest and the last value."""
        import numpy

        (n,) = self._one("SELECT count(*) FROM ev")
        if not n:
            return R.Live(unit=None, peak_bytes=0, peak_at=None, final_bytes=0, points=[])
        if timed:
            lo, hi = self._one("SELECT min(t), max(t) FROM ev")
        else:
            lo, hi = 0, n - 1  # untimed: the position in the trace (file after file)
        span = hi - lo + 1
        reader = self._time_ordered(n, timed)
        live = peak = 0
        peak_at = None
        done = 0
        buckets: dict[int, list[int]] = {}  # bucket -> [max, end, x of end]
        for batch in reader:
            if timed:
                x = batch.column(0).to_numpy().astype(numpy.float64) - lo
            else:
                x = numpy.arange(done, done + batch.num_rows, dtype=numpy.float64)
            done += batch.num_rows
            running = numpy.cumsum(batch.column(1).to_numpy(zero_copy_only=False)) + live
            k = int(running.argmax())
            if running[k] > peak:
                peak, peak_at = int(running[k]), int(x[k])
            b = numpy.minimum(LIVE_BUCKETS - 1, (x * LIVE_BUCKETS / span).astype(numpy.int64))
            starts = numpy.concatenate(([0], numpy.flatnonzero(numpy.diff(b)) + 1))
            ends = numpy.concatenate((starts[1:] - 1, [len(b) - 1]))
            for bucket, mx, end, at in zip(
                b[starts].tolist(),
                numpy.maximum.reduceat(running, starts).tolist(),
                running[ends].tolist(),
                x[ends].tolist(),
            ):
                prev = buckets.get(bucket)
                buckets[bucket] = [max(mx, prev[0]) if prev else mx, end, int(at)]
            live = int(running[-1])
        points = [
            R.LivePoint(bucket=k, at=at, max_bytes=mx, end_bytes=end) for k, (mx, end, at) in sorted(buckets.items())
        ]
        return R.Live(unit="ns" if timed else "row", peak_bytes=peak, peak_at=peak_at, final_bytes=live, points=points)

    def _time_ordered(self, n: int, timed: bool) -> Any:
        """Batches of (t, change of live bytes) of the N events in time order (t, file, seq)
        (TIMED: whether every event has a time).
        Above sort_events() events the sort is split into time ranges (bounds: approximate
        quantiles of t; every event of one t in one range), sorted one after the other: their
        concatenation is the order one sort would give. A trace without times is one sort."""
        parts = max(1, -(-n // self.sort_events())) if timed else 1
        bounds: list = []
        if parts > 1:
            qs = ", ".join(str(i / parts) for i in range(1, parts))
            (bounds,) = self._one(f"SELECT approx_quantile(t, [{qs}]) FROM ev")
            bounds = sorted(set(bounds))
        edges = [None, *bounds, None]
        for lo, hi in zip(edges[:-1], edges[1:]):
            where = " AND ".join(
                ([f"t >= {int(lo)}"] if lo is not None else []) + ([f"t < {int(hi)}"] if hi is not None else [])
            )
            rel = self.con.sql(
                """SELECT t, CASE WHEN alloc THEN size::BIGINT WHEN prev_alloc THEN -prev_size::BIGINT ELSE 0 END
                   FROM ev """
                + (f"WHERE {where} " if where else "")
                + "ORDER BY t, file, seq"
            )
            yield from (
                rel.to_arrow_reader(1 << 20) if hasattr(rel, "to_arrow_reader") else rel.fetch_record_batch(1 << 20)
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


_UNITS = {"": 1, "b": 1, "bytes": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (RLIMIT_AS, `ulimit
    -v`): the limit less what is mapped now (VmSize); None without a limit."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    with open("/proc/self/status") as f:
        mapped = next((int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:")), 0)
    return soft - mapped


def _thread_bytes() -> int:
    """The address space one more thread maps: its stack (glibc's default size is RLIMIT_STACK;
    counted as 8 MiB when that is unlimited) and its malloc arena's reservation."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return (8 << 20 if stack == resource.RLIM_INFINITY else stack) + THREAD_ARENA


def _fitted_threads(left: int, wanted: int) -> dict[str, int]:
    """DuckDB's thread settings when LEFT bytes of address space are left: WANTED threads, as
    many as a quarter of LEFT maps (_thread_bytes each, the calling thread free), and none of
    its asynchronous I/O threads (DuckDB 2.0 starts 8 at connect; local files need none)."""
    return {"threads": max(1, min(wanted, 1 + (left // 4) // _thread_bytes())), "async_threads": 0}


def _size_bytes(text: str) -> int:
    """Bytes of a DuckDB size setting as it reports it ("61.0 MiB", "1.0 GiB")."""
    number, _, unit = text.strip().partition(" ")
    try:
        return int(float(number) * _UNITS[unit.strip().lower()])
    except (ValueError, KeyError):
        raise PymtraceError(f"cannot understand DuckDB's memory limit {text!r}") from None
