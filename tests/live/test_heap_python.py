"""`pymtrace heap` on CPython programs: each sampled allocation's Python frames merged into its
native stack, on every interpreter tests/support/pychains.py finds (3.10-3.13), against the
workload's own chains (workloads/py_chains.py: the bytes each allocates as the interpreter
sizes them, one chain through libc's qsort calling back into Python, a thread, an asyncio
task), launched with -- CMD and attached with -p while it runs; every format; the views."""

import glob
import gzip
import json
import os
import re
import subprocess
import time

import pytest
from support import pychains
from support.cli import PYMTRACE, run_pymtrace
from support.pychains import CHAINS, OBJECTS, PYTHON_ONLY, WORKLOAD, folded, total

from pymtrace.sinks import profile_pb2
from pymtrace.tracee import elf

pytestmark = pytest.mark.bpf

PYTHONS = pychains.interpreters()
IDS = [name for name, _, _ in PYTHONS]
ALLOCATED = ("bytes_a", "list", "callback", "thread", "async")  # freed: alloc_space
LEAKED = ("dict", "leak")  # kept to the end: inuse_space


@pytest.fixture(params=PYTHONS, ids=IDS)
def python(request):
    _, path, minor = request.param
    return pychains.python_or_missing(path, minor)


def heap(out, *args, cmd=(), timeout=300):
    """heap -- CMD. Every call sampled from the interpreter's start (~10,000 samples in a burst,
    with stacks as deep as its imports): a ring that holds them all."""
    args = ("--ring-bytes", "1G", *args)
    proc = run_pymtrace("heap", "-o", out, *args, *(("--", *cmd) if cmd else ()), timeout=timeout)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    return proc


def heap_by_pid(python, out, *args):
    """heap -p on the workload while it runs (its chains run once heap is attached); stopped
    with Ctrl-C while the workload still lives. The workload's expected sizes."""
    target = subprocess.Popen([python, str(WORKLOAD), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        sizes = json.loads(target.stdout.readline())
        tracer = subprocess.Popen(
            [*PYMTRACE, "heap", "-p", str(target.pid), *args, "--duration", "120", "-o", str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        line = tracer.stderr.readline()
        assert "sampling PID" in line, line + tracer.stderr.read()
        target.stdin.write(b"go\n")
        target.stdin.flush()
        assert target.stdout.readline() == b"done\n"
        time.sleep(0.3)  # the last samples reach the ring before Ctrl-C
        tracer.send_signal(2)
        _, err = tracer.communicate(timeout=120)
        assert tracer.returncode == 0, err
        assert "Traceback" not in err
        return sizes, err
    finally:
        target.stdin.close()
        target.wait(timeout=30)


def check_chains(stacks_alloc, stacks_inuse, sizes):
    for name in ALLOCATED:
        assert total(stacks_alloc, CHAINS[name]) == sizes[name], (name, CHAINS[name])
    for name in LEAKED:
        assert total(stacks_inuse, CHAINS[name]) == sizes[name], (name, CHAINS[name])


def test_launched_every_chain_exact(python, tmp_path):
    """-- CMD, every call sampled: each chain's bytes, to the byte, on its exact merged stack
    (pprof: all four values in one file); Python functions are pprof Functions with their
    file, their Lines the line."""
    sizes = pychains.expected(python)
    out = tmp_path / "a.pb.gz"
    proc = heap(out, "--sample-bytes", "1", cmd=(python, WORKLOAD))
    version = ".".join(map(str, sizes["version"]))
    assert re.search(rf"python: pid \d+: CPython {re.escape(version)} ", proc.stderr), proc.stderr
    profile = read_pprof(out)
    check_chains(folded_from_pprof(profile, "alloc_space"), folded_from_pprof(profile, "inuse_space"), sizes)
    strings = profile.string_table
    functions = {(strings[f.name], strings[f.filename]) for f in profile.function}
    for name in ("leaf_a", "alpha", "compare", "callback_leaf", "thread_leaf", "async_leaf"):
        assert (name, str(WORKLOAD)) in functions, name
    assert "[python]" in {strings[m.filename] for m in profile.mapping}


def test_attached_every_chain_exact(python, tmp_path):
    """-p while it runs: the same chains, the same bytes; the report says how it was read."""
    out = tmp_path / "p.pb.gz"
    sizes, err = heap_by_pid(python, out, "--sample-bytes", "1")
    assert re.search(r"python: pid \d+: CPython 3\.\d+\.\d+ \(\S+\), layout from (table|_Py_DebugOffsets)", err)
    profile = read_pprof(out)
    alloc = folded_from_pprof(profile, "alloc_space")
    check_chains(alloc, folded_from_pprof(profile, "inuse_space"), sizes)
    assert total(alloc, OBJECTS) == 0  # pymalloc's objects: no malloc call


def test_python_allocators_see_pymalloc_objects(python, tmp_path):
    """--python-allocators: the object() instances pymalloc serves from its arenas, every one
    on its line, counted once (PyObject_Malloc and the domain function it calls are one call);
    a large object's malloc call is its PyObject_Malloc's, not counted twice."""
    out = tmp_path / "objects.pb.gz"
    sizes, err = heap_by_pid(python, out, "--python-allocators", "--sample-bytes", "1")
    interp = os.path.realpath(python)
    libpython = glob.glob(os.path.join(os.path.dirname(os.path.dirname(interp)), "lib", "libpython3*.so.1.0"))
    if "_PyObject_Malloc" not in elf.symbols(libpython[0] if libpython else interp):
        # a stripped interpreter (Debian's, built with LTO: most calls inlined) says so
        assert re.search(r"--python-allocators: \S+ has no _PyObject_Malloc symbol", err), err
        return
    profile = read_pprof(out)
    alloc = folded_from_pprof(profile, "alloc_space")
    assert total(folded_from_pprof(profile, "alloc_objects"), OBJECTS) == sizes["objects_count"]
    assert total(alloc, OBJECTS) == sizes["objects"]
    assert total(alloc, CHAINS["bytes_a"]) == 0  # its leaf is now the interpreter's allocator
    leaf_a = CHAINS["bytes_a"].removesuffix(f"{pychains.NATIVE};{pychains.MALLOC}") + pychains.NATIVE
    assert total(alloc, leaf_a) == sizes["bytes_a"]


def test_python_allocators_options(tmp_path):
    proc = run_pymtrace("heap", "--python-allocators", "--via", "interposer", "-o", tmp_path / "x", "--", "true")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--python-allocators" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def read_pprof(path):
    profile = profile_pb2.Profile()
    profile.ParseFromString(gzip.decompress(path.read_bytes()))
    return profile


def folded_from_pprof(profile, value):
    """{folded stack: VALUE} from a pprof profile, Python frames named as folded names them."""
    strings = profile.string_table
    functions = {f.id: f for f in profile.function}
    python = {m.id for m in profile.mapping if strings[m.filename] == "[python]"}
    locations = {}
    for loc in profile.location:
        names = []
        for line in loc.line:  # innermost first
            f = functions[line.function_id]
            name, file = strings[f.name], strings[f.filename]
            names.append(f"{name} ({file}:{line.line})" if loc.mapping_id in python else name)
        locations[loc.id] = list(reversed(names))
    index = [strings[t.type] for t in profile.sample_type].index(value)
    out = {}
    for sample in profile.sample:
        frames = [n for loc in reversed(sample.location_id) for n in locations[loc]]
        key = ";".join(frames)
        out[key] = out.get(key, 0) + sample.value[index]
    return out


@pytest.fixture
def one_python():
    """One interpreter for what does not depend on the version (formats, views): the system's
    if it is one the tests cover, else the first found."""
    for _, path, minor in reversed(PYTHONS):
        if path is not None and pychains.version_of(path) == minor:
            return path
    return pychains.python_or_missing(None, "3.10-3.13")


def test_text_and_html_name_python_frames(one_python, tmp_path):
    python = one_python
    text_out, html_out = tmp_path / "a.txt", tmp_path / "a.html"
    heap(text_out, "--sample-bytes", "1", "--value", "alloc_space", "--top", "50", cmd=(python, WORKLOAD))
    text = text_out.read_text()
    line = pychains.lines()["bytes_a"]
    assert re.search(rf"\n\t\tleaf_a \[python\] {re.escape(str(WORKLOAD))}:{line}\n\t\tbeta \[python\]", text), text
    heap(html_out, "--sample-bytes", "1", "--value", "alloc_space", cmd=(python, WORKLOAD))
    assert f"leaf_a ({WORKLOAD}:{line})" in html_out.read_text()


def test_views(one_python, tmp_path):
    """--python-only: the Python frames alone, the same bytes (folded); --native: no Python
    frame, the evaluation loop's native frames instead."""
    python = one_python
    sizes = pychains.expected(python)
    only, native = tmp_path / "only.folded", tmp_path / "native.folded"
    heap(only, "--python-only", "--sample-bytes", "1", "--value", "alloc_space", cmd=(python, WORKLOAD))
    stacks = folded(only)
    assert total(stacks, PYTHON_ONLY["bytes_a"]) == sizes["bytes_a"]
    assert total(stacks, PYTHON_ONLY["callback"]) == sizes["callback"]
    proc = heap(native, "--native", "--sample-bytes", "1", "--value", "alloc_space", cmd=(python, WORKLOAD))
    stacks = folded(native)
    assert not any(".py:" in s for s in stacks)
    assert any("_PyEval_EvalFrameDefault" in s for s in stacks)
    assert "python:" not in proc.stderr


def test_unreadable_interpreter_keeps_native_stacks(tmp_path):
    """A CPython it cannot read (3.9: outside 3.10-3.13) gets one line saying which and why,
    and native stacks; the run succeeds."""
    old = pychains.pyenv_python("3.9")
    if old is None:
        pytest.skip("no CPython 3.9 under pyenv to stand for an unsupported interpreter")
    out = tmp_path / "old.folded"
    proc = heap(out, "--sample-bytes", "1", cmd=(old, "-c", "x = [bytes(100000) for _ in range(3)]"))
    why = [line for line in proc.stderr.splitlines() if "CPython 3.9" in line]
    assert why and "3.10-3.13 only" in why[0] and "native stacks only" in why[0], proc.stderr
    assert not any(".py:" in s or "<string>" in s for s in folded(out))


def test_non_python_process_says_nothing_of_python(tmp_path):
    out = tmp_path / "sh.folded"
    proc = heap(out, "--sample-bytes", "1", cmd=("/bin/sh", "-c", "echo hi >/dev/null"))
    assert "python:" not in proc.stderr and "CPython" not in proc.stderr


def test_top_stacks_sites_are_python_lines(one_python):
    """top --stacks on a Python process: a call site is the innermost Python frame (the line
    that allocated), its stacks have the Python frames merged in, with files and lines."""
    target = subprocess.Popen([one_python, str(WORKLOAD), "loop"], stdout=subprocess.PIPE)
    try:
        target.stdout.readline()
        proc = run_pymtrace(
            "top", "--stacks", "--stack-sample-bytes", "1", "-p", target.pid, "--json", "-n", "2",
            "--view", "stacks", timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    finally:
        target.kill()
        target.wait()
    rows = json.loads(proc.stdout.splitlines()[-1])["views"]["stacks"]["rows"]
    sites = {(r["site"], r["module"]) for r in rows}
    assert {("leaf_a", "[python]"), ("leaf_list", "[python]")} <= sites, sites
    row = next(r for r in rows if r["site"] == "leaf_a")
    frames = row["stacks"][0]["frames"]
    python = [(f["function"], f["line"]) for f in frames if f["module"] == "[python]"]
    lines = pychains.lines()
    assert python[-3:] == [("alpha", lines["alpha_beta"]), ("beta", lines["beta_a"]), ("leaf_a", lines["bytes_a"])]
    assert all(f["file"] == str(WORKLOAD) for f in frames if f["function"] in ("alpha", "beta", "leaf_a"))
