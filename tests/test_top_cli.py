"""`pymtrace top` errors: one line on stderr and a non-zero exit."""
import os
import shutil
import subprocess

import pytest

from conftest import PYMTRACE, run_pymtrace


def test_gone_pid_is_one_line_error(bpf_ok):
    proc = run_pymtrace("top", "--batch", "-n", "1", "-p", 999999999 if os.path.exists("/proc/sys") else 1)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["pymtrace: error: process 999999999 does not exist (or exited)"]
    assert proc.stdout == ""


def test_not_root_is_one_line_error():
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is not installed")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + PYMTRACE
    else:
        cmd = list(PYMTRACE)
    proc = subprocess.run(cmd + ["top", "--batch", "-n", "1"], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["pymtrace: error: pymtrace top needs root (BPF and uprobes); run it with sudo"]


def test_bad_interval():
    proc = run_pymtrace("top", "--batch", "-i", "0")
    assert proc.returncode != 0
    assert "error" in proc.stderr
