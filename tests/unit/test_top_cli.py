"""`pymtrace top` errors without root or BPF: one line on stderr and a non-zero exit (those
that need root or BPF: tests/live/test_top_cli_bpf.py)."""

import os
import shutil
import subprocess

import pytest
from conftest import PYMTRACE, run_pymtrace


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
