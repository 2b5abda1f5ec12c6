"""An LD_PRELOAD library defining malloc and free whose first instruction the kernel will not
probe (`lock add`: x86 uprobes refuse LOCK-prefixed instructions, and the kernel answers
ENOTSUPP, 524, which has no name in user space): `record` and `top` say so in words, name the
instruction, and say that none of the file's probes is attached: through uprobe_multi links
and through perf events (forced with the test hook PYMTRACE_FAKE_NO_UPROBE_MULTI=1)."""

import os
import re
import subprocess

import pytest
from support.cli import run_pymtrace
from support.paths import WORKLOADS

from pymtrace.bpf import uprobes


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    """The preload counter library, built as a user would (-O2: no frame pointer, so malloc
    starts with its `lock add`)."""
    out = tmp_path_factory.mktemp("preload") / "libcounter.so"
    src = WORKLOADS / "lock_add_interposer.c"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True)
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(out)], capture_output=True, text=True).stdout
    first = re.search(r"<malloc>:\n\s*[0-9a-f]+:\s*(\S+)", dump)
    if not first or first.group(1) != "lock":
        pytest.skip(f"this compiler's malloc does not start with `lock`: {first and first.group(1)}")
    return str(out)


@pytest.fixture(params=["links", "perf events"])
def way(request, monkeypatch):
    if request.param == "links":
        if not uprobes.multi_links():
            pytest.skip("this kernel has no uprobe_multi links that filter by process")
    else:
        monkeypatch.setenv(uprobes.FAKE_NO_MULTI_ENV, "1")
    return request.param


def assert_said_in_words(stderr, path):
    assert "Unknown error 524" not in stderr, stderr
    line = next(line for line in stderr.splitlines() if path in line and "524" in line)
    assert "will not put a uprobe on" in line and "`lock add" in line, line
    assert "LOCK" in line and "ENOTSUPP" in line, line
    assert "none of the probes in this file is attached" in line, line


@pytest.mark.bpf
def test_record_says_why_the_kernel_refuses_the_probe(counter, tmp_path, way):
    run = run_pymtrace(
        "record", "-o", tmp_path / "out.mtrace", "--", "env", f"LD_PRELOAD={counter}", "/bin/true", timeout=240
    )
    assert run.returncode == 0, run.stderr
    assert_said_in_words(run.stderr, counter)


@pytest.mark.bpf
def test_top_says_why_the_kernel_refuses_the_probe(counter, way):
    env = dict(os.environ, LD_PRELOAD=counter)
    sleeper = subprocess.Popen(["sleep", "60"], env=env)
    try:
        run = run_pymtrace("top", "--batch", "-p", sleeper.pid, "-n", "1", "--view", "processes", timeout=240)
        assert run.returncode == 1, run.stdout + run.stderr
        assert_said_in_words(run.stderr, counter)
    finally:
        sleeper.kill()
        sleeper.wait()
