"""LD_PRELOAD libraries defining malloc and free whose first instruction the kernel will not
probe: x86 uprobes refuse an instruction with a LOCK or segment prefix, and the kernel answers
ENOTSUPP, 524, which has no name in user space. Through uprobe_multi links and through perf
events (forced with the test hook PYMTRACE_FAKE_NO_UPROBE_MULTI=1).

A counter whose functions start with `lock add` on a counter of its own: `record` probes each
at its next instruction (the same arguments and stack) and records every call exactly; `top`
says in words why it cannot probe the file, names the instruction, and says that none of the
file's probes is attached. A library whose functions are one `notrack jmp` to the next
definition (a refused instruction no probe can be moved past): `record` says the same in one
line and stops, exit 1, the trace keeping what it recorded until then."""

import json
import os
import re
import subprocess

import pytest
from support.allocators import record_workload
from support.cli import run_pymtrace
from support.paths import WORKLOADS
from support.recording import text_range
from support.top import Workload

from pymtrace.bpf import uprobes
from pymtrace.trace.formats import mtrace_bin as B


def _preload_library(directory, name, first):
    """tests/support/workloads/NAME.c as a shared library built as a user would (-O2: no
    frame pointer); a skip when this compiler's malloc does not start with FIRST."""
    out = directory / f"{name}.so"
    src = WORKLOADS / f"{name}.c"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True)
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(out)], capture_output=True, text=True).stdout
    found = re.search(r"<malloc>:\n\s*[0-9a-f]+:\s*(\S+)", dump)
    if not found or found.group(1) != first:
        pytest.skip(f"this compiler's malloc does not start with `{first}`: {found and found.group(1)}")
    return str(out)


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    """The preload counter library: malloc and free start with their `lock add`."""
    return _preload_library(tmp_path_factory.mktemp("preload"), "lock_add_interposer", "lock")


@pytest.fixture(scope="module")
def jumper(tmp_path_factory):
    """malloc and free are each one `notrack jmp` to the next definition."""
    return _preload_library(tmp_path_factory.mktemp("preload"), "jump_interposer", "notrack")


@pytest.fixture(params=["links", "perf events"])
def way(request, monkeypatch):
    if request.param == "links":
        if not uprobes.multi_links():
            pytest.skip("this kernel has no uprobe_multi links that filter by process")
    else:
        monkeypatch.setenv(uprobes.FAKE_NO_MULTI_ENV, "1")
    return request.param


def assert_said_in_words(stderr, path, instruction):
    assert "Unknown error 524" not in stderr, stderr
    line = next(line for line in stderr.splitlines() if path in line and "524" in line)
    assert "will not put a uprobe on" in line and f"`{instruction}" in line, line
    assert "LOCK" in line and "ENOTSUPP" in line, line
    assert "none of the probes in this file is attached" in line, line
    return line


def assert_pairs_recorded(trace, prog, truth):
    """The trace holds each of the workload's malloc/free pairs, made in PROG, exactly once."""
    lo, hi = text_range(prog)
    records = [r for r in B.read_file(trace) if lo <= r.caller < hi]
    mallocs = sorted((r.ptr2, r.size) for r in records if r.type == B.MALLOC)
    frees = sorted(r.ptr1 for r in records if r.type == B.FREE)
    assert len(records) == len(mallocs) + len(frees), [r.type for r in records]
    assert mallocs == sorted(tuple(m) for m in truth["malloc"])
    assert frees == sorted(truth["free"])
    assert len(frees) == 300


@pytest.mark.bpf
def test_record_p_probes_the_counter_past_its_lock_add(counter, cbuild, tmp_path, way):
    prog = cbuild("malloc_free_pairs", "-no-pie")
    out = tmp_path / "trace"
    truth = record_workload(Workload(["env", f"LD_PRELOAD={counter}", prog]), out)
    with open(out, "rb") as f:
        assert B.allocator_of(f.read(64)) == "generic"
    assert_pairs_recorded(out, prog, truth)


@pytest.mark.bpf
def test_record_cmd_probes_the_counter_past_its_lock_add(counter, cbuild, tmp_path, way):
    prog = cbuild("malloc_free_pairs", "-no-pie")
    out = tmp_path / "trace"
    run = run_pymtrace("record", "-o", out, "--", "env", f"LD_PRELOAD={counter}", prog, input="xx", timeout=240)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr and "524" not in run.stderr, run.stderr
    assert_pairs_recorded(out, prog, json.loads(run.stdout.splitlines()[-1]))


@pytest.mark.bpf
def test_record_stops_at_a_probe_it_cannot_place(jumper, cbuild, tmp_path, way):
    """After the exec into the program that preloads the library: one line, exit 1, the
    trace keeps env's records; the command runs on untraced."""
    prog = cbuild("malloc_free_pairs", "-no-pie")
    out = tmp_path / "trace"
    run = run_pymtrace("record", "-o", out, "--", "env", f"LD_PRELOAD={jumper}", prog, input="xx", timeout=240)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("pymtrace: error:")]
    assert len(errors) == 1, run.stderr
    line = assert_said_in_words(errors[0], jumper, "notrack jmp")
    assert "recording stopped" in line, line
    assert "warning" not in run.stderr, run.stderr
    assert len(list(B.read_file(out))) > 0  # env's calls, before its exec
    assert len(json.loads(run.stdout.splitlines()[-1])["free"]) == 300  # the command went on


@pytest.mark.bpf
def test_record_p_refuses_a_probe_it_cannot_place(jumper, tmp_path, way):
    sleeper = subprocess.Popen(["sleep", "60"], env=dict(os.environ, LD_PRELOAD=jumper))
    try:
        run = run_pymtrace("record", "-p", sleeper.pid, "-o", tmp_path / "out.mtrace", timeout=240)
        assert run.returncode == 1, run.stdout + run.stderr
        assert "Traceback" not in run.stderr, run.stderr
        assert_said_in_words(run.stderr, jumper, "notrack jmp")
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.bpf
def test_top_says_why_the_kernel_refuses_the_probe(counter, way):
    env = dict(os.environ, LD_PRELOAD=counter)
    sleeper = subprocess.Popen(["sleep", "60"], env=env)
    try:
        run = run_pymtrace("top", "--batch", "-p", sleeper.pid, "-n", "1", "--view", "processes", timeout=240)
        assert run.returncode == 1, run.stdout + run.stderr
        assert_said_in_words(run.stderr, counter, "lock add")
    finally:
        sleeper.kill()
        sleeper.wait()
