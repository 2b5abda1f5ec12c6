"""The environment `heap -- CMD` gives a command sampled in-process (sources.interposer's
sampling mode helpers), and how heap tells, from a process's own environment and program,
whether a new image will run the interposer. No BPF: real processes, no root needed."""

import os
import subprocess
import sys

import pytest

from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources import interposer

LIB = "/opt/lib/pymtrace-interpose-0123.so"


def test_sampling_env_preloads_the_library_first_and_says_how_to_sample():
    base = {"PATH": "/bin", "LD_PRELOAD": "libjemalloc.so.2 ", "PYMTRACE_RING": "1:1:1024:/dev/shm/x"}
    env = interposer.sampling_env(base, LIB, interposer.SampleOptions(524288, 1000, follow=False))
    assert env["LD_PRELOAD"] == f"{LIB}:libjemalloc.so.2"
    assert "PYMTRACE_RING" not in env  # sampling writes no ring
    assert env["PYMTRACE_SAMPLE"] == f"{os.getpid()}:0:524288:1000" and env["PATH"] == "/bin"
    assert base["LD_PRELOAD"] == "libjemalloc.so.2 "  # the caller's mapping is left alone
    follow = interposer.sampling_env({}, LIB, interposer.SampleOptions(1, 5, follow=True))
    assert follow["LD_PRELOAD"] == LIB and follow["PYMTRACE_SAMPLE"] == f"{os.getpid()}:1:1:5"


@pytest.mark.parametrize("lib", ["/tmp/a b/lib.so", "/tmp/a:b/lib.so"])
def test_a_path_ld_preload_cannot_name_is_refused(lib):
    with pytest.raises(PymtraceError, match="space or colon"):
        interposer.sampling_env({}, lib, interposer.SampleOptions(1, 5))


def _waiting(ld_preload):
    """A python3 running (past its exec: its environment is in place), with LD_PRELOAD set to
    LD_PRELOAD, waiting on its stdin."""
    env = dict(os.environ, LD_PRELOAD=ld_preload)
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout.readline() == b"up\n"
    return proc


def test_preload_problem_reads_the_processes_own_environment():
    cleared = _waiting("")
    try:
        why = interposer.preload_problem(cleared.pid, LIB)
        assert why is not None and "LD_PRELOAD no longer names the interposer" in why
    finally:
        cleared.communicate(b"")
    with pytest.raises(ProcessGone):
        interposer.preload_problem(cleared.pid, LIB)  # reaped: gone
    named = _waiting(f"libfirst.so {LIB}")  # missing libraries: the loader says so and goes on
    try:
        assert interposer.preload_problem(named.pid, LIB) is None  # a dynamic python3: preloadable
    finally:
        named.communicate(b"")
