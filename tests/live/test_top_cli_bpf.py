"""`pymtrace top` errors that need root or BPF: one line on stderr and a non-zero exit; the
rest is tests/unit/test_top_cli.py."""

import os
import shutil
import signal
import subprocess
import tempfile

import pytest
from support.cli import PYMTRACE, run_pymtrace, script_background
from support.needs import missing_or_fail
from support.paths import ROOT
from support.uprobes import ProbeWatch


def test_gone_pid_is_one_line_error(bpf_ok):
    proc = run_pymtrace("top", "--batch", "-n", "1", "-p", 999999999 if os.path.exists("/proc/sys") else 1)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["pymtrace: error: process 999999999 does not exist (or exited)"]
    assert proc.stdout == ""


def test_not_root_is_one_line_error_beside_a_checkout_named_pymtrace():
    """The test VMs' layout: the project synced to /pymtrace and `python -m pymtrace` run from
    / with an editable install, by a user who is not root. The checkout in the current
    directory must not shadow the package (as a namespace package, which would end in an
    ImportError traceback): the error is the one line that says top needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run as another user (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    where = tempfile.mkdtemp(prefix="pymtrace-cwd-")
    try:
        os.chmod(where, 0o755)  # the other user must see the checkout from there
        os.symlink(ROOT, os.path.join(where, "pymtrace"))
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + PYMTRACE
        proc = subprocess.run(
            cmd + ["top", "--batch", "-n", "1"], capture_output=True, text=True, timeout=60, cwd=where
        )
    finally:
        shutil.rmtree(where)
    assert proc.stderr.strip().splitlines() == [
        "pymtrace: error: pymtrace top needs root (BPF and uprobes); run it with sudo"
    ]
    assert proc.returncode == 1


@pytest.mark.bpf
@pytest.mark.parametrize("command", [["top", "--batch", "-n", "1"], ["record"], ["summary"]])
def test_unreadable_maps_is_one_line_error(command, tmp_path):
    """`-p PID` of a process whose /proc/PID/maps pymtrace cannot read (pymtrace runs as root
    of a user namespace of an unprivileged user, like in a container or sandbox): one line,
    exit 1, no traceback."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        missing_or_fail("unshare/setpriv (util-linux) are not installed")
    target = subprocess.Popen(["sleep", "60"])
    try:
        cmd = (
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "unshare",
                "-U",
                "-r",
                "env",
                f"PYTHONPATH={ROOT}",
            ]
            + PYMTRACE
            + command
            + ["-p", str(target.pid)]
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        target.kill()
        target.wait()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"pymtrace: error: cannot read /proc/{target.pid}/maps: Permission denied (pymtrace needs the "
        "process's memory map: run it where it can see the process, e.g. in the same container)"
    ]


@pytest.mark.bpf
def test_top_batch_stops_on_sigint_sent_by_a_script(cbuild):
    """`pymtrace top --batch -p P & ... kill -INT $!` from a script (SIGINT ignored in the
    background job): top stops as on Ctrl-C, with its reports printed and its probes gone."""
    prog = cbuild("record_loop")
    target = subprocess.Popen([prog], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        with script_background("top", "--batch", "-i", "0.5", "-p", target.pid) as (shell, pid):
            seen = []
            watch = ProbeWatch(pid)
            for line in shell.stdout:  # reports every 0.5 s once attached (start-up may take long)
                seen.append(line)
                if "iteration 3 " in line:
                    break
            watch.wait_attached(3, timeout=5)
            os.kill(pid, signal.SIGINT)
            out, err = shell.communicate(timeout=60)
    finally:
        target.kill()
        target.wait()
    out = "".join(seen) + out
    assert "iteration 3 " in out, err
    assert out.rstrip().endswith("rc=0"), err
    assert "Traceback" not in err
    assert str(target.pid) in out
    watch.assert_gone()
