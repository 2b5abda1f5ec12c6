"""A recording names its callers offline: `record` keeps the traced process's executable
mappings (Parquet: metadata; mtrace-bin: FILE.maps), and `analyze` and `dump` print each
caller's function (file:line) from them and the binary, also after the trace was copied alone to
another directory; a binary gone since gives addresses and a one-line note. Ground truth: the
workload heap_calls makes each kind of call from a function of its own, on a known line."""

import json
import os
import re
import shutil

import pytest
from support.cli import run_pymtrace
from support.paths import WORKLOADS

pytestmark = pytest.mark.bpf

# the function each call is made from, and the text of its line in heap_calls.c
CALLS = {
    "chain_leaf": "void *p = malloc(n);",
    "leak_leaf": "void *p = malloc(n);",
    "calloc_leaf": "void *p = calloc(n, m);",
    "aligned_alloc_leaf": "void *p = aligned_alloc(align, n);",
    "thread_leaf": "void *p = malloc(n);",
}


def line_of(function):
    """The line of FUNCTION's call in heap_calls.c (the first CALLS[function] after its start)."""
    lines = (WORKLOADS / "heap_calls.c").read_text().splitlines()
    start = next(n for n, text in enumerate(lines) if text.startswith(f"LEAF void *{function}("))
    return next(n for n in range(start, len(lines)) if CALLS[function] in lines[n]) + 1


@pytest.fixture(scope="module")
def program(cbuild, tmp_path_factory):
    """A copy of heap_calls (-O2, no frame pointers) that a test may remove."""
    d = tmp_path_factory.mktemp("prog")
    prog = d / "heap_calls"
    shutil.copy(cbuild("heap_calls", "-O2", "-fomit-frame-pointer"), prog)
    return prog


def record(prog, out, *args):
    proc = run_pymtrace("record", "-o", out, *args, "--", prog, "calls", input="\n")
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout


def callers(trace):
    proc = run_pymtrace("analyze", "--json", trace)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    return rep, {c.get("function"): c for c in rep["callers"]}


def check_named(trace):
    rep, by_function = callers(trace)
    for function in CALLS:
        assert function in by_function, sorted(map(str, by_function))
        source = by_function[function]["source"]
        assert re.fullmatch(rf"\S*heap_calls\.c:{line_of(function)}", source), (function, source)
    assert by_function["leak_leaf"]["never_freed"] == 7 and by_function["chain_leaf"]["allocations"] >= 100
    assert rep["symbols"]["source"] == "maps" and rep["symbols"]["files_missing"] == []
    return rep


def test_parquet_names_callers_offline(program, tmp_path):
    trace = tmp_path / "made" / "hc.parquet"
    trace.parent.mkdir()
    record(program, trace)
    check_named(trace)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(trace, elsewhere / "hc.parquet")  # the trace alone
    shutil.rmtree(trace.parent)
    check_named(elsewhere / "hc.parquet")
    text = run_pymtrace("analyze", elsewhere / "hc.parquet", check=True).stdout
    assert re.search(rf" leak_leaf \(\S*heap_calls\.c:{line_of('leak_leaf')}\) ", text), text


def test_mtrace_bin_names_callers_from_its_side_file_in_analyze_and_dump(program, tmp_path):
    trace = tmp_path / "hc.bin"
    record(program, trace)
    assert os.path.exists(f"{trace}.maps")
    check_named(trace)
    dump = run_pymtrace("dump", trace, check=True).stdout
    leak = [ln for ln in dump.splitlines() if " leak_leaf (" in ln]
    assert len(leak) == 7 and all(ln.endswith(f"heap_calls.c:{line_of('leak_leaf')})") for ln in leak)


def test_a_binary_gone_since_leaves_addresses_and_one_note(program, tmp_path):
    prog = tmp_path / "heap_calls"
    shutil.copy(program, prog)
    trace = tmp_path / "hc.parquet"
    record(prog, trace)
    os.unlink(prog)
    rep, by_function = callers(trace)
    assert not any(f in by_function for f in CALLS)
    assert rep["symbols"]["files_missing"] == [str(prog)]
    proc = run_pymtrace("analyze", trace, check=True)
    assert proc.stdout.count(f"not found on this machine, their callers stay addresses: {prog}") == 1
