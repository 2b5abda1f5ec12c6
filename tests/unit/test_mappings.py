"""The executable mappings a trace keeps (trace/mappings.py) name its callers offline (no root,
no BPF): the maps of a live C workload of the tests' own (heap_calls, which prints its load
address) read as `record` reads them, then addresses in its known functions named from a
Parquet file's metadata and from an mtrace-bin trace's FILE.maps by `analyze` (text, HTML,
JSON) and `dump`; after copying the trace alone elsewhere; with the binary gone (addresses and
a one-line note); from a debug file found by build ID; traces without maps print as before."""

import json
import os
import re
import shutil
import subprocess

import numpy
import pytest
from support.cli import analyze_json, run_pymtrace
from support.paths import WORKLOADS

from pymtrace.trace import mappings
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P
from pymtrace.tracee import elf

LEAVES = ("chain_leaf", "leak_leaf", "calloc_leaf")


def declared_at(function):
    """The line heap_calls.c declares FUNCTION on."""
    for n, line in enumerate((WORKLOADS / "heap_calls.c").read_text().splitlines(), 1):
        if re.match(rf"LEAF void \*{function}\(", line):
            return n
    raise AssertionError(function)


@pytest.fixture(scope="module")
def workload(cbuild, tmp_path_factory):
    """(binary, its maps log, {leaf: an address inside it}) of heap_calls while it waits: its own
    copy of the binary, which the tests may remove."""
    d = tmp_path_factory.mktemp("maps")
    prog = d / "heap_calls"
    shutil.copy(cbuild("heap_calls", "-O2", "-fomit-frame-pointer"), prog)
    proc = subprocess.Popen([prog, "calls"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _, pid, base = proc.stdout.readline().split()
        log = mappings.MapsLog(int(pid), "t.parquet")
        assert log.snapshot() and not log.snapshot()  # the second read finds nothing new
    finally:
        proc.kill()
        proc.wait()
    # a return address just past each leaf's first instruction: the call "made" there is in it
    where = {f: int(base, 16) + elf.symbol(str(prog), f).address + 1 for f in LEAVES}
    return prog, log, where


def records(where):
    """Calls from each leaf: malloc(100 + k) k + 1 times from the k-th leaf, never freed."""
    rows = []
    t = 1000
    for k, f in enumerate(LEAVES):
        for _ in range(k + 1):
            t += 1000
            rows.append((1, B.MALLOC, 0, 0x10000 + t, 100 + k, 0, 112, t, where[f]))
    rows.append((1, B.MALLOC, 0, 0x90000, 5, 0, 32, t + 1, 0x1234))  # an address in no mapping
    return numpy.array(rows, B.record_dtype("<"))


def write_parquet(path, where, log=None):
    meta = P.file_metadata()
    if log is not None:
        meta["pymtrace." + mappings.METADATA_KEY] = log.text()
    with open(path, "wb") as f:
        P.write_records(f, iter([records(where)]), meta)


def write_bin(path, where, log):
    path.write_bytes(B.magic_record(1) + P.raw_bytes(records(where)))
    mappings.side_path(str(path))
    with open(mappings.side_path(str(path)), "w") as f:
        f.write(log.text())


def named(rep):
    return {c["caller"]: (c.get("function"), c.get("source")) for c in rep["callers"]}


def check_names(rep, where):
    names = named(rep)
    for f in LEAVES:
        function, source = names[f"{where[f]:#x}"]
        file, _, line = source.rpartition(":")
        assert function == f and file.endswith("heap_calls.c"), (function, source)
        assert declared_at(f) <= int(line) <= declared_at(f) + 1, (f, source)
    assert names["0x1234"] == (None, None)
    assert rep["symbols"]["source"] == "maps" and rep["symbols"]["callers_symbolized"] == len(LEAVES)


def test_the_log_holds_the_executable_mappings_with_build_ids(workload):
    prog, log, _ = workload
    maps = mappings.parse(log.text().splitlines(), "log")
    mine = [m for m in maps.mappings if m.path == str(prog)]
    assert mine and all(m.build_id == elf.build_id(str(prog)) for m in mine)
    assert any("libc" in os.path.basename(m.path) for m in maps.mappings)
    m = mine[0]
    assert maps.lookup(m.start) == m and maps.lookup(m.end - 1) == m and maps.lookup(m.end) != m


def test_analyze_and_dump_name_callers_of_a_parquet_trace_copied_alone(workload, tmp_path):
    _, log, where = workload
    made = tmp_path / "made"
    made.mkdir()
    write_parquet(made / "t.parquet", where, log)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(made / "t.parquet", elsewhere / "t.parquet")  # the trace alone
    shutil.rmtree(made)
    trace = elsewhere / "t.parquet"
    rep = analyze_json(trace)
    check_names(rep, where)
    assert rep["symbols"]["files_missing"] == []
    nf = {c["caller"]: c["function"] for c in rep["never_freed"]["by_caller"]}
    assert nf[f"{where['leak_leaf']:#x}"] == "leak_leaf"

    text = run_pymtrace("analyze", trace, check=True).stdout
    line = declared_at("leak_leaf")
    assert re.search(rf"{where['leak_leaf']:#x} leak_leaf \(\S*heap_calls.c:({line}|{line + 1})\)", text), text
    # the live-bytes peak is the last row, 5.001 us after the first: in ms
    assert "peak 613 at 0.005 ms from the start" in text, text

    html = tmp_path / "r.html"
    run_pymtrace("analyze", trace, "--html", html, check=True)
    assert "leak_leaf (" in html.read_text()

    dump = run_pymtrace("dump", "--limit", "3", trace, check=True)
    assert [ln.split()[-2] for ln in dump.stdout.splitlines()[:3]] == ["chain_leaf", "leak_leaf", "leak_leaf"]
    doc = json.loads(run_pymtrace("dump", "--json", "--limit", "1", trace, check=True).stdout)
    assert doc["records"][0]["function"] == "chain_leaf"


def test_mtrace_bin_keeps_them_in_its_side_file(workload, tmp_path):
    _, log, where = workload
    trace = tmp_path / "t.bin"
    write_bin(trace, where, log)
    check_names(analyze_json(trace), where)
    os.unlink(mappings.side_path(str(trace)))  # without the side file: addresses, as before
    rep = analyze_json(trace)
    assert "function" not in rep["callers"][0] and rep["symbols"] == {"source": None, "callers_symbolized": 0}


def test_convert_carries_them_into_every_format(workload, tmp_path):
    _, log, where = workload
    trace = tmp_path / "t.bin"
    write_bin(trace, where, log)
    run_pymtrace("convert", trace, tmp_path / "t.parquet", "--to", "parquet", check=True)
    check_names(analyze_json(tmp_path / "t.parquet"), where)
    run_pymtrace("convert", tmp_path / "t.parquet", tmp_path / "back.bin", "--to", "mtrace-bin", check=True)
    assert (tmp_path / "back.bin.maps").read_text() == log.text()
    check_names(analyze_json(tmp_path / "back.bin"), where)
    run_pymtrace("convert", trace, tmp_path / "t.txt", "--to", "mtrace-text", check=True)
    assert (tmp_path / "t.txt.maps").read_text() == log.text()


def test_a_missing_binary_leaves_addresses_and_a_one_line_note(workload, tmp_path):
    prog, log, where = workload
    text = log.text().replace(str(prog), str(tmp_path / "gone" / "heap_calls"))
    gone = mappings.MapsLog(1, "t")
    gone._lines = text.splitlines(keepends=True)
    trace = tmp_path / "t.parquet"
    write_parquet(trace, where, gone)
    rep = analyze_json(trace)
    assert all(c.get("function") is None for c in rep["callers"])
    assert rep["symbols"]["files_missing"] == [str(tmp_path / "gone" / "heap_calls")]
    proc = run_pymtrace("analyze", trace, check=True)
    notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("(not found on this machine")]
    assert len(notes) == 1 and str(tmp_path / "gone" / "heap_calls") in notes[0]
    assert f"{where['leak_leaf']:#x}" in proc.stdout and proc.stderr == ""
    proc = run_pymtrace("dump", "--limit", "1", trace, check=True)
    assert proc.stdout.splitlines()[0].split()[-1] == f"{where['chain_leaf']:#014x}"
    assert proc.stderr.count("\n") == 1 and "not found on this machine" in proc.stderr


def test_a_debug_file_found_by_build_id_stands_in_for_the_binary(workload, tmp_path, monkeypatch):
    prog, log, where = workload
    build_id = elf.build_id(str(prog))
    root = tmp_path / "debug" / ".build-id"
    (root / build_id[:2]).mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", prog, root / build_id[:2] / (build_id[2:] + ".debug")], check=True)
    text = log.text().replace(str(prog), str(tmp_path / "gone" / "heap_calls"))
    maps = mappings.parse(text.splitlines(), "log")
    monkeypatch.setattr(mappings, "DEBUG_ROOT", str(root))
    sym = mappings.Symbolizer()
    place = sym.place(maps, 0, where["leak_leaf"])
    assert place is not None and place.function == "leak_leaf" and place.file.endswith("heap_calls.c")
    assert not sym.missing


def test_traces_without_maps_report_as_before(workload, tmp_path):
    _, _, where = workload
    trace = tmp_path / "t.parquet"
    write_parquet(trace, where)
    rep = analyze_json(trace)
    assert rep["symbols"] == {"source": None, "callers_symbolized": 0}
    assert all(set(c) == {"caller", "calls", "allocations", "requested_bytes", "frees", "never_freed",
                          "never_freed_bytes"} for c in rep["callers"])  # fmt: skip
    dump = run_pymtrace("dump", "--limit", "1", trace, check=True)
    assert dump.stdout.splitlines()[0].split()[-1] == f"{where['chain_leaf']:#014x}" and dump.stderr == ""
