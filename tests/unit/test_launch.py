"""target.launch without root: a launched command run until its loader has mapped its objects
(the r_debug rendezvous), each exec stopped the same way, and a running held command let go."""

import os
import signal
import subprocess
import time

import pytest
from support.allocators import LIBS, library
from support.needs import missing_or_fail

from pymtrace.tracee import libc
from pymtrace.tracee.launch import Launched


def test_stopped_with_its_libraries_mapped_before_any_initializer():
    """At the stop every object is mapped (libc and the preload), and nothing of the program
    ran: an LD_PRELOADed library's constructor has not run yet (jemalloc's maps no arena)."""
    jemalloc = library(LIBS["jemalloc"])
    launched = Launched(["/bin/true"], env=dict(os.environ, LD_PRELOAD=jemalloc))
    try:
        assert launched.run_until_loaded() == "rendezvous"
        paths = {m.path for m in libc.read_maps(launched.pid)}
        assert libc.process_libc(launched.pid) in paths
        assert os.path.realpath(jemalloc) in {os.path.realpath(p) for p in paths if p.startswith("/")}
        found = libc.allocator(launched.pid)
        assert found.name == "jemalloc" and found.path and "libjemalloc" in found.path
        # the loader's own heap only: no [heap] yet, which libc's first malloc would create
        assert "[heap]" not in paths
    finally:
        launched.kill()
    assert launched.proc.returncode == -signal.SIGKILL


def test_each_exec_stops_with_the_new_programs_objects_mapped():
    jemalloc = library(LIBS["jemalloc"])
    seen = []
    launched = Launched(["env", f"LD_PRELOAD={jemalloc}", "/bin/true"], stdout=subprocess.DEVNULL)
    assert launched.run_until_loaded() == "rendezvous"
    assert libc.allocator(launched.pid).name == "glibc"  # env itself
    launched.resume(on_exec=lambda pid: seen.append(libc.allocator(pid).name))
    assert launched.wait(30) == 0
    assert seen == ["jemalloc"]


def test_a_static_program_needs_no_stop(tmp_path):
    src = tmp_path / "s.c"
    src.write_text("int main(void) { return 7; }\n")
    exe = tmp_path / "s"
    try:
        subprocess.run(["gcc", "-static", "-o", exe, src], check=True)
    except (FileNotFoundError, subprocess.CalledProcessError):
        missing_or_fail("gcc cannot link statically (libc6-dev's libc.a)")
    launched = Launched([str(exe)])
    assert launched.run_until_loaded() == "exec"
    launched.resume()
    assert launched.wait(30) == 7


def test_a_held_command_let_go_runs_on_and_gets_its_signals():
    launched = Launched(["/bin/sh", "-c", "trap 'exit 5' USR1; while :; do sleep 0.05; done"])
    launched.run_until_loaded()
    launched.resume(on_exec=lambda pid: None)
    time.sleep(0.3)
    for _ in range(20):  # its children's SIGCHLDs pass through the tracer
        assert launched.service() is None
        time.sleep(0.02)
    launched.release()
    assert not launched.held
    assert launched.proc.poll() is None  # still running, untraced
    os.kill(launched.pid, signal.SIGUSR1)
    assert launched.proc.wait(30) == 5


def test_a_command_whose_loader_fails_is_reported(tmp_path):
    """A library the loader cannot find: the command ends before the stop, one PymtraceError."""
    from pymtrace.errors import PymtraceError

    (tmp_path / "l.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "m.c").write_text("int f(void); int main(void) { return f(); }\n")
    try:
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libgone.so", tmp_path / "l.c"], check=True)
        subprocess.run(["gcc", "-o", tmp_path / "m", tmp_path / "m.c", "-L", tmp_path, "-lgone"], check=True)
    except FileNotFoundError:
        missing_or_fail("gcc is not installed")
    os.unlink(tmp_path / "libgone.so")
    launched = Launched([str(tmp_path / "m")], stderr=subprocess.DEVNULL)
    with pytest.raises(PymtraceError, match="exited before its libraries were loaded"):
        launched.run_until_loaded()
    assert launched.proc.returncode == 127
