"""`pymtrace record --stacks` on CPython programs: every allocation's stack with the Python
frames merged in, against the workload's own chains (workloads/py_chains.py: the bytes and
calls of each, tests/support/pychains.py), as `dump --stacks` and `dump --stats` show them;
launched with -- CMD on every interpreter pychains finds, attached with -p on one."""

import json
import re
import subprocess
import time

import pytest
from support import pychains
from support.cli import PYMTRACE, run_pymtrace
from support.pychains import CHAINS, WORKLOAD, total

pytestmark = pytest.mark.bpf

PYTHONS = pychains.interpreters()
# the chains whose calls and bytes the workload counts (the dict's keys grow through resizes)
CALLS = {"bytes_a": 20, "list": 10, "callback": 5, "thread": 7, "async": 3, "leak": 1}
# every allocation the interpreter makes from its start has its stack: a ring that holds them
BUFFER = ("--buffer-size", "512M")
_NATIVE_FRAME = re.compile(r"^(.*?)(?: \([^()]*:\d+\))? \S+\+0x[0-9a-f]+(?: \[inlined\])?$")


def dumped(path):
    """{folded stack root first, Python frames "name (file:line)": [calls, bytes]} of the
    allocations in `dump --stacks PATH`."""
    proc = run_pymtrace("dump", "--stacks", path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out, size, frames = {}, None, []

    def done():
        if size is not None and frames:
            entry = out.setdefault(";".join(reversed(frames)), [0, 0])
            entry[0] += 1
            entry[1] += size

    for line in proc.stdout.splitlines():
        if line.startswith("           "):  # a frame of the record above, leaf first
            text = line.strip()
            if text.endswith(" [python]"):
                frames.append(text.removesuffix(" [python]"))
            else:
                m = _NATIVE_FRAME.match(text)
                frames.append(m.group(1) if m else text)
            continue
        done()
        fields = line.split()
        size = int(fields[5]) if len(fields) > 10 and fields[0].isdigit() and "stack=" in line else None
        frames = []
    done()
    return out


def check_chains(stacks, sizes):
    calls = {s: v[0] for s, v in stacks.items()}
    nbytes = {s: v[1] for s, v in stacks.items()}
    for name, n in CALLS.items():
        assert total(calls, CHAINS[name]) == n, (name, CHAINS[name])
        assert total(nbytes, CHAINS[name]) == sizes[name], name
    assert total(calls, CHAINS["dict"]) >= 1  # its keys, grown through resizes (each recorded)


@pytest.mark.parametrize("name,path,minor", PYTHONS, ids=[p[0] for p in PYTHONS])
def test_launched_chains_exact(name, path, minor, tmp_path):
    """-- CMD: each chain's calls and bytes on its exact merged stack; --stats' top stack by
    bytes is leaf_list's, through alpha and beta; the summary names the interpreter."""
    python = pychains.python_or_missing(path, minor)
    sizes = pychains.expected(python)
    out = tmp_path / "t"
    proc = run_pymtrace("record", "--stacks", *BUFFER, "-o", out, "--", python, WORKLOAD, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # a CPython program's frames are read in BPF: through uprobes, saying why
    assert "reads a Python program's frames in BPF" in proc.stderr
    version = re.escape(".".join(map(str, sizes["version"])))
    assert re.search(
        rf"python: pid \d+: CPython {version} .*; Python frames in [1-9]\d* of \d+ allocations", proc.stderr
    )
    check_chains(dumped(out), sizes)
    stats = run_pymtrace("dump", "--stats", out)
    assert stats.returncode == 0, stats.stderr
    top = stats.stdout.split("top stacks by bytes requested", 1)[1].splitlines()[2]
    assert re.search(r"^\s+\d+\s+10\s+\d+\s+.*;main;alpha;beta;leaf_list;.*malloc$", top), top


def test_attached_chains_exact(tmp_path):
    """-p while it runs (the newest interpreter found), to Parquet: the same chains, calls and
    bytes; analyze's top stack is leaf_list's, its Python frames named with file and line."""
    found = [p for p in PYTHONS if p[1] is not None and pychains.version_of(p[1])]
    _, path, minor = found[-1] if found else PYTHONS[-1]
    python = pychains.python_or_missing(path, minor)
    out = tmp_path / "p.parquet"
    target = subprocess.Popen([python, str(WORKLOAD), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        sizes = json.loads(target.stdout.readline())
        tracer = subprocess.Popen(
            [*PYMTRACE, "record", "--stacks", "-p", str(target.pid), "--duration", "120", "-o", str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        line = tracer.stderr.readline()
        while line and "recording process" not in line:
            line = tracer.stderr.readline()
        assert line, tracer.stderr.read()
        target.stdin.write(b"go\n")
        target.stdin.flush()
        assert target.stdout.readline() == b"done\n"
        time.sleep(0.3)  # the last records reach the ring before Ctrl-C
        tracer.send_signal(2)
        _, err = tracer.communicate(timeout=120)
        assert tracer.returncode == 0, err
        assert "Traceback" not in err
    finally:
        target.stdin.close()
        target.wait(timeout=30)
    assert re.search(r"python: pid \d+: CPython 3\.\d+\.\d+ \(\S+\), layout from (table|_Py_DebugOffsets)", err), err
    check_chains(dumped(out), sizes)
    report = json.loads(run_pymtrace("analyze", "--json", out, check=True).stdout)
    top = report["stacks"]["top"][0]
    assert top["calls"] == CALLS["list"], top
    want = [pychains.frame(f, m).replace(" ", "") for f, m in (("leaf_list", "list"), ("beta", "beta_list"))]
    assert re.fullmatch(r".*;" + ";".join(want) + r";.*", ";".join(top["stack"])), top


def test_native_stacks_of_a_python_program_are_taken_in_process(tmp_path):
    """--stacks --native: in-process (the interposer unwinds), every allocation with a native
    stack through the interpreter's C frames, no Python frames."""
    name, path, minor = PYTHONS[-1]
    python = pychains.python_or_missing(path, minor)
    out = tmp_path / "t"
    proc = run_pymtrace("record", "--stacks", "--native", "--json", "-o", out, "--", python, WORKLOAD, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["via"] == "interposer" and summary["stacks_lost"] == 0 and summary["stacks"] > 100
    stacks = dumped(out)
    assert not any("(py_chains.py:" in s for s in stacks)
    assert any(";_PyEval_EvalFrameDefault;" in s for s in stacks)
