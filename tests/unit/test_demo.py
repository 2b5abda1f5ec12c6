"""The bundled demo workload: built on first use into a cache directory, started, stopped."""

import os
import subprocess
import sys
import time

import pytest

from pymtrace.errors import PymtraceError
from pymtrace.tracee import demo


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def minflt(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def thp_enabled(pid):
    """THP_enabled of /proc/PID/status: 0 once the process disabled huge pages (prctl)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("THP_enabled:")))


def test_build_once_and_run_with_visible_activity(cache):
    if not any(os.access(os.path.join(d, "gcc"), os.X_OK) for d in os.environ["PATH"].split(os.pathsep)):
        pytest.skip("gcc is not installed")
    path = demo.build_demo()
    assert path.startswith(str(cache)) and os.path.basename(path) == "pymtrace-demo"
    mtime = os.stat(path).st_mtime_ns
    assert demo.build_demo() == path and os.stat(path).st_mtime_ns == mtime  # cached, not rebuilt
    proc = demo.start_demo()
    try:
        from pymtrace.tracee import libc

        assert libc.process_libc(proc.pid)  # ready to be traced when start_demo returns
        with open(f"/proc/{proc.pid}/comm") as f:
            assert f.read().strip() == "pymtrace-demo"
        time.sleep(0.3)
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 8  # main + 7 workers
        # THP off (prctl), so the pager's faults are 4 KiB ones even where THP is "always"
        # (Debian's kernels; on this host's "madvise" the test below would pass without it)
        assert thp_enabled(proc.pid) == 0
        before = minflt(proc.pid)
        # the pager thread touches a 32 MiB calloc page by page after ~1 s: 8192 faults
        deadline = time.monotonic() + 10
        while minflt(proc.pid) - before < 8000 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert minflt(proc.pid) - before >= 8000
    finally:
        demo.stop_demo(proc)
    assert proc.returncode == 0  # SIGTERM ends it cleanly
    demo.stop_demo(proc)  # twice is harmless


def test_timed_run_exits_by_itself(cache):
    proc = demo.start_demo(seconds=1, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert f"pid {proc.pid}" in out.decode()


def test_missing_compiler_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-for-pymtrace")
    with pytest.raises(PymtraceError, match="needs a C compiler: `no-such-cc-for-pymtrace` not found; install gcc"):
        demo.build_demo()


def test_demo_dies_with_its_parent(cache):
    code = "import sys, time; from pymtrace.tracee import demo; p = demo.start_demo(); print(p.pid, flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    pid = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{pid}")
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # gone; ESRCH: read while it exits
            break
        if state == "Z":  # exited, waiting for init to reap it
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the demo outlived its parent")
