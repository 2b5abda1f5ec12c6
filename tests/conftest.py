"""Shared test fixtures.

BPF tests carry `@pytest.mark.bpf` (or use the `bpf_ok` fixture). Without root/BPF/BCC
they skip with the reason -- except under PYMTRACE_REQUIRE_BPF=1 (CI), where they fail.
"""
import contextlib
import functools
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
REQUIRE_BPF = os.environ.get("PYMTRACE_REQUIRE_BPF") == "1"
PYMTRACE = [sys.executable, "-m", "pymtrace"]


def missing_or_fail(reason):
    """Skip with REASON, or fail when CI requires BPF tests to run."""
    if REQUIRE_BPF:
        pytest.fail(f"PYMTRACE_REQUIRE_BPF=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@functools.lru_cache(maxsize=None)
def bpf_problem():
    """Why BPF tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root"
    try:
        import bcc
    except ImportError:
        return "BCC's Python module (python3-bpfcc) is not importable"
    if not hasattr(bcc, "BPF"):
        return "the `bcc` module is the unrelated PyPI package"
    from pymtrace import bpfload

    try:
        bpfload.ensure_tracefs()
    except Exception as exc:
        return str(exc)
    if not os.path.exists(f"/lib/modules/{os.uname().release}/build"):
        return "no kernel headers for BCC (run ./install.sh)"
    return None


@pytest.fixture
def bpf_ok():
    problem = bpf_problem()
    if problem:
        missing_or_fail(problem)


def pytest_runtest_setup(item):
    if item.get_closest_marker("bpf"):
        problem = bpf_problem()
        if problem:
            missing_or_fail(problem)


@functools.lru_cache(maxsize=None)
def _sdt_libc_dir():
    """A directory with a probe-carrying glibc (+ its loader), or None.

    Found by inspecting ELF notes, never by distro name: the system libc if it carries the
    malloc probes (Fedora, Ubuntu, ...), else ../shared/glibc-sdt, else $PYMTRACE_SDT_LIBC_DIR.
    """
    from pymtrace import libc

    candidates = [os.environ.get("PYMTRACE_SDT_LIBC_DIR"), str(ROOT.parent / "shared" / "glibc-sdt")]
    system = libc.system_libc()
    if system and len(libc.malloc_probes(system)) > 0:
        return "system"
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "libc.so.6")) and libc.malloc_probes(os.path.join(d, "libc.so.6")):
            return os.path.realpath(d)  # the path processes map (and tools report), links resolved
    return None


@pytest.fixture
def sdt_libc():
    """(run_prefix, libc_path): run argv as run_prefix + argv to use a probe-carrying libc."""
    d = _sdt_libc_dir()
    if d is None:
        missing_or_fail("no glibc with malloc USDT probes (system libc has none, ../shared/glibc-sdt absent)")
    from pymtrace import libc

    if d == "system":
        return [], libc.system_libc()
    return [os.path.join(d, "ld-linux-x86-64.so.2"), "--library-path", d], os.path.join(d, "libc.so.6")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cbuild")


@pytest.fixture(scope="session")
def cbuild(build_dir):
    """cbuild("name", *extra_flags) compiles tests/workloads/name.c and returns the binary path.

    -fno-builtin keeps gcc from eliding malloc/free pairs; frame pointers keep stacks usable.
    """
    if shutil.which("gcc") is None:
        missing_or_fail("gcc is not installed")

    @functools.lru_cache(maxsize=None)
    def build(name, *flags):
        src = WORKLOADS / f"{name}.c"
        out = build_dir / (name + ("-" + "-".join(f.strip("-").replace("=", "_") for f in flags) if flags else ""))
        cmd = ["gcc", "-O1", "-g", "-fno-builtin", "-fno-omit-frame-pointer", "-pthread",
               "-I", str(WORKLOADS), "-o", str(out), str(src), *flags]
        subprocess.run(cmd, check=True)
        return str(out)

    return build


def run_pymtrace(*args, check=False, timeout=120, **kw):
    """Run the pymtrace CLI in a subprocess (the real entry point), capturing output."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    proc = subprocess.run(PYMTRACE + [str(a) for a in args], timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"pymtrace {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


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
    shell = subprocess.Popen(["bash", "-c", f"{line} & echo $!; wait $!; echo rc=$?"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
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
