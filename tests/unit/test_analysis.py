"""`pymtrace analyze` (no root): exact numbers on synthetic traces whose ground truth is computed
independently (tests/support/synthetic.py) and on a hand-made trace of known calls, through
every input format; spilling under a low memory limit; the read-only --sql; corrupt inputs; the
HTML report as a file (headless Chromium draws it in tests/integration/test_analysis_html.py)."""

import io
import json
import os
import re

import numpy
import pyarrow
import pyarrow.parquet as pq
import pytest
from support import synthetic
from support.cli import analyze_json, run_pymtrace

from pymtrace.errors import BadQuery
from pymtrace.trace.analysis import SORT_BYTES_PER_EVENT, TraceSet
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P

STEPS, SLOTS, THREADS = 30_000, 500, 4


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    path = d / "synth.parquet"
    synthetic.write(str(path), STEPS, SLOTS, THREADS)
    return path, synthetic.truth(STEPS, SLOTS, THREADS)


def report(*paths, **kw):
    """The report's dict in process (the CLI's --json prints it; checked once through the CLI)."""
    with TraceSet([str(p) for p in paths], **kw) as ts:
        return json.loads(json.dumps(ts.report().to_json()))


def check_against_truth(rep, truth):
    assert {name: c["count"] for name, c in rep["calls"].items()} == truth["counts"]
    assert rep["totals"]["events"] == truth["events"]
    assert rep["totals"]["requested_bytes"] == truth["requested_bytes"]
    assert rep["live"]["peak_bytes"] == truth["peak_live_bytes"]
    assert rep["live"]["final_bytes"] == truth["final_live_bytes"]
    assert rep["never_freed"]["count"] == truth["never_freed"]
    assert rep["never_freed"]["requested_bytes"] == truth["final_live_bytes"]
    life = rep["lifetimes"]
    assert life["freed"] == truth["freed"] and life["cross_thread_frees"] == truth["cross_thread_frees"]
    assert life["min_ns"] == truth["lifetime_min_ns"] and life["max_ns"] == truth["lifetime_max_ns"]
    assert life["releases_of_unknown_blocks"] == 0 and life["allocations_over_live_blocks"] == 0
    assert sum(h["count"] for h in life["histogram"]) == truth["freed"]
    assert sum(h["count"] for h in rep["sizes"]["histogram"]) == truth["events"] - truth["counts"]["free"]


def test_synthetic_parquet_exact(synth, tmp_path):
    path, truth = synth
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rep = analyze_json(path, "--temp-dir", tmp)
    check_against_truth(rep, truth)
    assert os.listdir(tmp) == []  # the private directory is gone
    # sizes: every 997th request is 200,000 bytes: at or above the 128 KiB mmap threshold
    big = len(range(0, STEPS, 997))
    mm = rep["sizes"]["mmap_threshold"]
    assert mm["at_or_above"]["count"] == big == mm["threshold_to_double"]
    assert mm["below"]["count"] == STEPS - big
    cls = {h["class"]: h["count"] for h in rep["sizes"]["histogram"]}
    assert cls["(128 KiB, 256 KiB]"] == big
    assert rep["threads"]["count"] == THREADS and len(rep["threads"]["timeline"]["threads"]) == THREADS
    assert sum(sum(t["calls"]) for t in rep["threads"]["timeline"]["threads"]) == truth["events"]
    assert sum(t["cross_thread_frees"] for t in rep["threads"]["top"]) == truth["cross_thread_frees"]
    assert sum(c["calls"] for c in rep["callers"]) == truth["events"]  # 5 callers, top 10
    assert rep["stacks"] == {"recorded": False, "top": []}


def test_other_formats_and_many_files_give_the_same_numbers(synth, tmp_path):
    path, truth = synth
    raw, back = tmp_path / "synth.bin", tmp_path / "back.parquet"
    run_pymtrace("convert", path, raw, "--to", "mtrace-bin", check=True)
    run_pymtrace("convert", raw, back, "--to", "parquet", check=True)
    rep = analyze_json(raw)
    check_against_truth(rep, truth)
    assert rep["files"] == [{"path": str(raw), "format": "mtrace-bin", "allocator": "glibc"}]
    check_against_truth(report(back), truth)
    # a glob of two files: counts add up, addresses pair within each file only
    d = tmp_path / "many"
    d.mkdir()
    os.link(path, d / "a.parquet")
    os.link(back, d / "b.parquet")
    rep = report(str(d / "*.parquet"))
    assert rep["totals"]["files"] == 2
    assert {n: c["count"] for n, c in rep["calls"].items()} == {n: 2 * c for n, c in truth["counts"].items()}
    assert rep["never_freed"]["count"] == 2 * truth["never_freed"]
    assert rep["lifetimes"]["min_ns"] == truth["lifetime_min_ns"]
    assert rep["lifetimes"]["allocations_over_live_blocks"] == 0
    assert report(d)["totals"] == rep["totals"]  # a directory: its *.parquet


def test_spills_under_a_low_memory_limit(tmp_path):
    """600k events under a 30 MB limit: the events table alone is larger, so DuckDB must spill;
    the numbers stay exact and the spill is gone afterwards."""
    steps, slots = 300_000, 2000
    path = tmp_path / "big.parquet"
    synthetic.write(str(path), steps, slots, THREADS)
    truth = synthetic.truth(steps, slots, THREADS)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with TraceSet([str(path)], memory_limit="30MB", threads=1, temp_dir=str(tmp)) as ts:
        rep = ts.report().to_json()
        assert ts.spilled_bytes() > 0
    check_against_truth(rep, truth)
    assert os.listdir(tmp) == []


def test_sorts_in_partitions(tmp_path):
    """Events beyond what one DuckDB sort may hold sort in partitions (address hash, time ranges);
    every number stays exact. The number a sort may hold comes from the memory limit: at 24 MB
    and one thread 1.5M events, so 2M events sorted in 2 partitions there (one sort of them all
    ran out of memory; ~80 s on a loaded machine). Here sort_events sets it so that 200k events
    make 4 partitions at the same limit, and the limit's own value is checked separately."""
    steps, slots = 100_000, 2000
    path = tmp_path / "big.parquet"
    synthetic.write(str(path), steps, slots, THREADS)
    truth = synthetic.truth(steps, slots, THREADS)
    with TraceSet([str(path)], memory_limit="24MB", threads=1, temp_dir=str(tmp_path), sort_events=1 << 16) as ts:
        rep = ts.report().to_json()
        assert ts.partitions() >= 3
        ts.max_sort_events = None  # the limit's own value: 24 MB (DuckDB says 22.8 MiB) / 16 B
        assert 0.99 * 24e6 / SORT_BYTES_PER_EVENT <= ts.sort_events() <= 24e6 / SORT_BYTES_PER_EVENT
    check_against_truth(rep, truth)


# ---------------------------------------------------------------- a trace of known calls


def rec(thread, typ, p1=0, p2=0, size=0, s2=0, s3=0, t=0, caller=0x401000):
    return (thread, typ, p1, p2, size, s2, s3, t, caller)


def known_calls():
    """Calls whose pairing is known: a realloc chain, realloc(p, 0), a failed malloc, free(NULL),
    a failed posix_memalign, a cross-thread free, a free of a block from before the trace."""
    M, C, F, R, PM = B.MALLOC, B.CALLOC, B.FREE, B.REALLOC, B.POSIX_MEMALIGN
    ms = 1_000_000
    rows = [
        rec(1, M, p2=0xA0, size=10, t=1 * ms, caller=0x401100),
        rec(1, R, p1=0xA0, p2=0xB0, size=20, t=2 * ms, caller=0x401200),  # moved
        rec(1, R, p1=0xB0, p2=0xB0, size=30, t=3 * ms, caller=0x401200),  # in place
        rec(1, R, p1=0xB0, p2=0xC0, size=40, t=4 * ms, caller=0x401200),  # moved
        rec(2, C, p2=0xD0, size=1000, t=5 * ms),
        rec(1, M, size=1 << 62, t=6 * ms),  # fails
        rec(1, F, t=7 * ms),  # free(NULL)
        rec(1, PM, p1=22, size=64, s2=3, t=8 * ms),  # EINVAL
        rec(1, F, p1=0xD0, t=9 * ms),  # cross-thread: thread 2 allocated it
        rec(1, F, p1=0xE0, t=10 * ms),  # allocated before the trace
        rec(2, M, p2=0xF0, size=200_000, t=11 * ms),
        rec(2, R, p1=0xF0, size=0, t=1011 * ms),  # realloc(p, 0): frees after 1 s
        rec(1, F, p1=0xC0, t=1012 * ms),  # the chain's end
        rec(2, M, p2=0x100, size=5, t=1013 * ms),  # never freed
    ]
    return numpy.array(rows, B.record_dtype("<"))


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    path = tmp_path_factory.mktemp("known") / "known.parquet"
    with open(path, "wb") as f:
        P.write_records(f, iter([known_calls()]), P.file_metadata())
    return path


def test_known_calls(known):
    rep = report(known)
    counts = {n: c["count"] for n, c in rep["calls"].items()}
    assert counts == {"malloc": 4, "realloc": 4, "calloc": 1, "free": 4, "posix_memalign": 1}
    assert rep["calls"]["malloc"]["failed"] == 1 and rep["calls"]["posix_memalign"]["failed"] == 1
    assert rep["calls"]["realloc"]["failed"] == 0  # realloc(p, 0) returning NULL is no failure
    assert rep["totals"]["free_null"] == 1
    life = rep["lifetimes"]
    # paired: 0xA0, 0xB0 twice (realloc), 0xD0, 0xF0, 0xC0
    assert life["freed"] == 6 and life["cross_thread_frees"] == 1
    assert life["releases_of_unknown_blocks"] == 1  # free(0xE0); free(NULL) releases nothing
    assert life["min_ns"] == 1_000_000 and life["max_ns"] == 1_008_000_000
    assert rep["live"]["peak_bytes"] == 200_000 + 40 and rep["live"]["final_bytes"] == 5
    assert rep["never_freed"] == {
        "count": 1,
        "requested_bytes": 5,
        "by_caller": [{"caller": "0x401000", "count": 1, "requested_bytes": 5}],
    }
    ch = rep["realloc_chains"]
    assert (ch["chains"], ch["reallocs_linked"], ch["in_place"], ch["moved"], ch["released"]) == (2, 4, 1, 2, 1)
    assert ch["grew"] == 3
    assert ch["shrank"] == 1  # 200,000 -> 0
    first = ch["longest"][0]
    assert (first["reallocs"], first["first_size"], first["final_size"], first["moves"]) == (3, 10, 40, 2)
    assert first["caller"] == "0x401100" and first["first_call"] == "malloc"
    assert {h["reallocs"]: h["chains"] for h in ch["length_histogram"]}["2-3"] == 1


def test_the_recorded_allocator_is_shown(known, tmp_path):
    """json totals, text and html name the allocator each trace says it was recorded from."""
    assert report(known)["totals"]["allocators"] == ["glibc"]
    je = tmp_path / "je.trace"
    with open(je, "wb") as f:
        f.write(B.magic_record(1, allocator="jemalloc"))
        f.write(known_calls().tobytes())
    rep = report(je)
    assert rep["totals"]["allocators"] == ["jemalloc"] and rep["files"][0]["allocator"] == "jemalloc"
    from pymtrace.sinks.analysis_html import write_html
    from pymtrace.sinks.analysis_text import write_text

    with TraceSet([str(je)]) as ts:
        rep = ts.report()
    text, page = io.StringIO(), io.StringIO()
    write_text(rep, text)
    write_html(rep, page)
    assert "recorded from jemalloc" in text.getvalue() and "recorded from jemalloc" in page.getvalue()


def test_collect_dataset_parts_of_one_stream_are_one_recording(known, tmp_path):
    """`pymtrace collect`'s layout: a directory tree of parts; the parts of one stream
    (pymtrace.stream) are one recording, so a block allocated in one part and freed in a
    later one is paired, exactly as in the single file."""
    rows = known_calls()
    part_dir = tmp_path / "dataset" / "host=h" / "date=2026-11-24" / "pid=7"
    part_dir.mkdir(parents=True)
    for offset, chunk in ((0, rows[:7]), (7, rows[7:])):
        with open(part_dir / f"part-s1-{offset}.parquet", "wb") as f:
            P.write_records(f, iter([chunk]), P.file_metadata(stream="s1", first_offset=offset))
    split, whole = report(str(tmp_path / "dataset")), report(known)
    for key in ("calls", "lifetimes", "live", "never_freed", "realloc_chains"):
        assert split[key] == whole[key], key


def write_with_stacks(table, stacks, path):
    """TABLE written to PATH with its `stack` column STACKS (a list per row, or None)."""
    field = P.SCHEMA.field("stack")
    pq.write_table(
        table.set_column(table.schema.get_field_index("stack"), field, pyarrow.array(stacks, field.type)), path
    )


def test_stacks_when_recorded(known, tmp_path):
    table = pq.read_table(known)
    stacks = [[0x401000 + i, 0x402000] if i % 2 else None for i in range(table.num_rows)]
    path = tmp_path / "stacks.parquet"
    write_with_stacks(table, stacks, path)
    rep = report(path)
    assert rep["stacks"]["recorded"] and rep["stacks"]["calls_with_stack"] == table.num_rows // 2
    assert rep["stacks"]["top"][0]["stack"][1] == "0x402000"


def test_callers_symbolized_from_a_stack_table(tmp_path):
    """A `record --stacks` recording (stack_id column, FILE.stacks beside it): callers get the
    function and source line of their allocating frame, the top stacks their frames; without
    the table they stay addresses (a trace keeps no memory maps to symbolize with)."""
    recs = known_calls()
    allocating = recs["type"] != B.FREE
    ids = numpy.where(recs["caller"] == 0x401200, 2, 1)
    recs["type"] |= numpy.where(allocating, ids, 0).astype(numpy.uint32) << 8
    path = tmp_path / "s.parquet"
    with open(path, "wb") as f:
        P.write_records(f, iter([recs]), P.file_metadata(), stacks=True)
    plain = report(path)
    assert plain["symbols"] == {"source": None, "callers_symbolized": 0}
    assert "function" not in plain["callers"][0] and not plain["stacks"]["recorded"]

    def frame(function, line, offset):
        return {"function": function, "file": "w.c", "line": line, "module": "/w", "build_id": "ab", "offset": offset}

    lines = [
        {"format": "pymtrace-stacks", "version": 1, "trace": "s.parquet", "pid": 1},
        {"id": 1, "complete": True, "frames": [frame("main", 3, 0x1000), frame("make", 9, 0x1100)]},
        {"id": 2, "complete": True, "frames": [frame("main", 4, 0x1008), frame("grow", 17, 0x1200)]},
    ]
    (tmp_path / "s.parquet.stacks").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = report(path)
    by = {c["caller"]: c for c in rep["callers"]}
    assert by["0x401200"]["function"] == "grow" and by["0x401200"]["source"] == "w.c:17"
    assert by["0x401100"]["function"] == "make" and by["0x401000"]["function"] == "make"
    assert rep["symbols"] == {"source": "stack table", "callers_symbolized": 3}
    assert rep["never_freed"]["by_caller"][0]["function"] == "make"
    assert rep["stacks"]["recorded"] and rep["stacks"]["calls_with_stack"] == 10
    top = rep["stacks"]["top"][0]
    assert (
        top["stack"] == ["make(w.c:9)", "main(w.c:3)"]
        and top["requested_bytes"] == 10 + 1000 + 200_005 + (1 << 62) + 64
    )
    assert rep["totals"] == plain["totals"]


TIED = 24  # stacks with the same calls and bytes, more than the top list holds


def _tied_calls(order):
    """One malloc of 8 bytes at each of the keys ORDER, in that order, after two heavier ones."""
    rows = [rec(1, B.MALLOC, p2=0x1000 * (k + 1), size=8, t=k + 1) for k in range(len(order))]
    return numpy.array([rec(1, B.MALLOC, p2=0x90, size=100, t=0)] * 2 + rows, B.record_dtype("<"))


def test_top_stacks_with_ties_in_a_defined_order(tmp_path):
    """Stacks with equal calls and bytes: after the heavier one, the smallest stacks
    (element by element) in ascending order, in the top list as at its cut (the report's SQL,
    DuckDB and Spark alike)."""
    order = [(k * 7) % TIED for k in range(TIED)]  # every key once, not in order
    recs = _tied_calls(order)
    stacks = [[0x402000, 0x401000]] * 2 + [[0x500000 + (k << 12), 0x401000] for k in order]
    path = tmp_path / "ties.parquet"
    write_with_stacks(P.table_from_records(recs), stacks, path)
    for threads in (1, 2):
        with TraceSet([str(path)], threads=threads) as ts:
            top = ts.report(top=5).to_json()["stacks"]["top"]
        assert [t["stack"][0] for t in top] == ["0x402000"] + [hex(0x500000 + (k << 12)) for k in range(4)]
        assert [(t["calls"], t["requested_bytes"]) for t in top] == [(2, 200)] + [(1, 8)] * 4


def test_top_stack_ids_with_ties_in_a_defined_order(tmp_path):
    """The same for a `record --stacks` recording's stack ids (its stack table beside it):
    equal calls and bytes, the smallest ids first."""
    heavy = TIED + 1
    ids = [1 + (k * 7) % TIED for k in range(TIED)]  # every id of 1..TIED once, not in order
    recs = _tied_calls(ids)
    recs["type"] |= numpy.array([heavy, heavy] + ids, numpy.uint32) << 8  # the stack id of each call
    path = tmp_path / "s.parquet"
    with open(path, "wb") as f:
        P.write_records(f, iter([recs]), P.file_metadata(), stacks=True)
    frames = [{"function": "f", "file": "w.c", "line": 1, "module": "/w", "build_id": "ab", "offset": 0x1000}]
    lines = [{"format": "pymtrace-stacks", "version": 1, "trace": "s.parquet", "pid": 1}]
    lines += [{"id": i, "complete": True, "frames": frames} for i in range(1, heavy + 1)]
    (tmp_path / "s.parquet.stacks").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for threads in (1, 2):
        with TraceSet([str(path)], threads=threads) as ts:
            top = ts.report(top=5).to_json()["stacks"]["top"]
        assert [t["stack_id"] for t in top] == [heavy, 1, 2, 3, 4]


def test_text_log_input(known, tmp_path):
    text = tmp_path / "known.txt"
    run_pymtrace("convert", known, text, "--to", "mtrace-text", check=True)
    rep = report(text)
    assert rep["files"][0]["format"] == "mtrace-text" and rep["live"]["unit"] == "row"
    assert rep["lifetimes"]["min_ns"] is None  # a text log has no times


# ---------------------------------------------------------------- the typed report


def test_json_prints_the_report_model(known, tmp_path):
    """`analyze --json` prints the typed report's to_json(), byte for byte: sections in their
    order, `class` for the histograms' labels, and a caller's function and source only once a
    stack table symbolized the report (then null where it knew no frame)."""
    recs = known_calls()
    allocating = recs["type"] != B.FREE
    recs["type"] |= numpy.where(allocating & (recs["caller"] == 0x401200), 1, 0).astype(numpy.uint32) << 8
    symbolized = tmp_path / "s.parquet"
    with open(symbolized, "wb") as f:
        P.write_records(f, iter([recs]), P.file_metadata(), stacks=True)
    frame = {"function": "grow", "file": "w.c", "line": 17, "module": "/w", "build_id": "ab", "offset": 0x1200}
    lines = [{"format": "pymtrace-stacks", "version": 1, "trace": "s.parquet", "pid": 1}]
    lines.append({"id": 1, "complete": True, "frames": [frame]})
    (tmp_path / "s.parquet.stacks").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for path in (known, symbolized):
        with TraceSet([str(path)]) as ts:
            model = ts.report()
        printed = run_pymtrace("analyze", path, "--json", check=True).stdout
        assert printed == json.dumps(model.to_json(), indent=1) + "\n"
        rep = json.loads(printed)
        assert list(rep) == [
            "files", "settings", "totals", "calls", "sizes", "lifetimes", "live", "never_freed",
            "threads", "realloc_chains", "callers", "stacks", "symbols",
        ]  # fmt: skip
        assert rep["sizes"]["histogram"][1] == {"class": "(0, 16]", "max": 16, "count": model.sizes.histogram[1].count}
        assert [h["class"] for h in rep["lifetimes"]["histogram"]][:2] == ["< 1 us", "1 us - 10 us"]
        callers = {c["caller"]: c for c in rep["callers"]}
        if path == known:
            assert "function" not in callers["0x401200"] and "source" not in callers["0x401000"]
            assert rep["stacks"] == {"recorded": False, "top": []}
        else:
            assert callers["0x401200"]["function"] == "grow" and callers["0x401200"]["source"] == "w.c:17"
            assert callers["0x401000"]["function"] is None and "source" in callers["0x401000"]
            assert list(rep["stacks"]) == ["recorded", "source", "calls_with_stack", "top"]
            assert list(rep["stacks"]["top"][0]) == ["file", "stack_id", "stack", "calls", "requested_bytes"]


# ---------------------------------------------------------------- --sql


def test_sql_query_and_its_limits(known, tmp_path):
    proc = run_pymtrace("analyze", known, "--sql", "SELECT type, count(*) AS n FROM calls GROUP BY type ORDER BY type")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "type\tn" and "free\t4" in lines and "realloc\t4" in lines
    proc = run_pymtrace("analyze", known, known, "--json", "--sql", "SELECT file, count(*) AS n FROM calls GROUP BY 1")
    assert proc.returncode == 0 and json.loads(proc.stdout) == [{"file": 0, "n": 14}]  # the same file once
    proc = run_pymtrace("analyze", known, "--sql", "SELECT nonsense FROM calls")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("pymtrace: error: query failed: Binder Error")
    out = tmp_path / "out.csv"
    before = known.read_bytes()
    for bad in (
        f"COPY calls TO '{out}'",
        f"COPY (SELECT 1 AS a) TO '{known}' (FORMAT parquet, USE_TMP_FILE false)",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SET enable_external_access = true",
        f"ATTACH '{tmp_path / 'x.db'}'",
        "INSTALL httpfs",
    ):
        with TraceSet([str(known)]) as ts, pytest.raises(BadQuery) as err:
            ts.query(bad)
        assert err.value.exit_code == 2 and "\n" not in str(err.value), bad
    assert not out.exists() and not (tmp_path / "x.db").exists() and known.read_bytes() == before


# ---------------------------------------------------------------- bad inputs


def test_truncated_or_corrupt_parquet_is_one_line_exit_2(known, tmp_path):
    data = known.read_bytes()
    cases = {
        "truncated.parquet": data[: len(data) // 2],
        "footer.parquet": data[:-12] + b"\xff" * 4 + data[-8:],
        "pages.parquet": data[:8] + bytes(b ^ 0x5A for b in data[8:-200]) + data[-200:],
        "empty.parquet": b"PAR1",
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        proc = run_pymtrace("analyze", path)
        assert proc.returncode == 2, (name, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("pymtrace: error: "), proc.stderr
        assert "Traceback" not in proc.stderr
    proc = run_pymtrace("analyze", tmp_path / "none*.parquet")
    assert proc.returncode == 1 and proc.stderr.strip() == f"pymtrace: error: {tmp_path}/none*.parquet: no file matches"


# ---------------------------------------------------------------- HTML


@pytest.fixture(scope="module")
def html_report(synth, tmp_path_factory):
    path, _ = synth
    out = tmp_path_factory.mktemp("html") / "report.html"
    rep = analyze_json(path, "--html", out)
    return out, rep


def test_html_file_is_private_self_contained_and_not_replaced(html_report, synth):
    out, _ = html_report
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    text = out.read_text()
    assert "<script" not in text and not re.search(r"(src|href)=", text)  # nothing loaded from anywhere
    assert text.count("<svg") >= 5
    proc = run_pymtrace("analyze", synth[0], "--html", out)
    assert proc.returncode == 1 and "exists" in proc.stderr
    link = out.parent / "link.html"
    link.symlink_to(out)
    proc = run_pymtrace("analyze", synth[0], "--html", link, "--force", "--json")
    assert proc.returncode == 0 and not link.is_symlink() and out.exists()
