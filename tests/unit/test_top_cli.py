"""`pymtrace top` errors without root or BPF: one line on stderr and a non-zero exit (those
that need root or BPF: tests/live/test_top_cli_bpf.py)."""

import os
import shutil
import subprocess

import pytest
from support.cli import PYMTRACE, run_pymtrace


def test_not_root_is_one_line_error():
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is not installed")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + PYMTRACE
    else:
        cmd = list(PYMTRACE)
    proc = subprocess.run(cmd + ["top", "--batch", "-n", "1"], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "pymtrace: error: pymtrace top needs root (BPF and uprobes); run it with sudo"
    ]


def test_bad_interval():
    proc = run_pymtrace("top", "--batch", "-i", "0")
    assert proc.returncode != 0
    assert "error" in proc.stderr


@pytest.mark.parametrize("how", [("--stacks",), ("--view", "stacks"), ("--view", "5")])
def test_stacks_view_without_pid_is_one_line_error(how):
    proc = run_pymtrace("top", "--batch", "-n", "1", *how)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "pymtrace: error: the stacks view (--stacks, view 5) needs -p PID: the heap sampler attaches per process"
    ]


def test_stack_sample_bytes_must_parse():
    proc = run_pymtrace("top", "--batch", "--stacks", "-p", "1", "--stack-sample-bytes", "lots")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["pymtrace: error: --stack-sample-bytes: cannot parse 'lots' (e.g. 64M)"]
    proc = run_pymtrace("top", "--batch", "--stacks", "-p", "1", "--stack-sample-bytes", "0")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "pymtrace: error: --stack-sample-bytes must be from 1 to 4294967295, not 0"
    ]
