"""Running the pymtrace CLI as a subprocess (its real entry point), as a script does it, and
reading what a C workload of tests/support/workloads prints."""

import contextlib
import os
import signal
import subprocess
import sys

from support.paths import ROOT

PYMTRACE = [sys.executable, "-m", "pymtrace"]


def run_pymtrace(*args, check=False, timeout=120, **kw):
    """Run the pymtrace CLI in a subprocess (the real entry point), capturing output."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    proc = subprocess.run(PYMTRACE + [str(a) for a in args], timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"pymtrace {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def analyze_json(*args, env=None):
    """`pymtrace analyze --json ARGS`'s report, the command having succeeded."""
    import json

    proc = run_pymtrace("analyze", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def workload_facts(out):
    """The ground truth a C workload prints, one `KEY VALUE...` line each: {KEY: [[VALUE...], ...]}."""
    facts = {}
    for line in out.splitlines():
        parts = line.split()
        if parts:
            facts.setdefault(parts[0], []).append(parts[1:])
    return facts


@contextlib.contextmanager
def script_background(*args, env=None):
    """`pymtrace ARGS &` started by a non-interactive shell, as a script does it (such a shell
    starts background jobs with SIGINT ignored): yields (the shell's Popen, pymtrace's PID).
    The shell prints `rc=N` on stdout when pymtrace ends; pymtrace's stderr is the shell's.
    Whatever still runs at the end (pymtrace, a command it launched) is killed: the shell
    runs in a session of its own."""
    import shlex

    line = " ".join(shlex.quote(str(a)) for a in PYMTRACE + list(args))
    shell = subprocess.Popen(
        ["bash", "-c", f"{line} & echo $!; wait $!; echo rc=$?"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pid = int(shell.stdout.readline())
    try:
        yield shell, pid
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shell.communicate()


def sigint_ignored(pid):
    """Whether PID ignores SIGINT (the SigIgn mask of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (2 - 1)))
