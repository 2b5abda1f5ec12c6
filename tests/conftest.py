"""Fixtures and hooks shared by every tier (helpers are in tests/support/).

tests/unit needs no root and starts no JVM, server process or browser; tests/integration
starts them (Spark's JVM, Prometheus, `pymtrace collect`, Chromium, `go tool pprof`): its
tests carry the `integration` marker. BPF tests (tests/live) carry `@pytest.mark.bpf` (or use
the `bpf_ok` fixture); without root/BPF/BCC they skip with the reason -- except under
PYMTRACE_REQUIRE_BPF=1 (CI), where they fail.
"""

import functools
import os
import pathlib
import shutil
import subprocess

import pytest
from support.needs import bpf_problem, missing_or_fail, sdt_libc_dir
from support.paths import WORKLOADS

INTEGRATION = pathlib.Path(__file__).resolve().parent / "integration"


@pytest.fixture
def bpf_ok():
    problem = bpf_problem()
    if problem:
        missing_or_fail(problem)


def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)


def pytest_runtest_setup(item):
    if item.get_closest_marker("bpf"):
        problem = bpf_problem()
        if problem:
            missing_or_fail(problem)


@pytest.fixture
def sdt_libc():
    """(run_prefix, libc_path): run argv as run_prefix + argv to use a probe-carrying libc."""
    d = sdt_libc_dir()
    if d is None:
        missing_or_fail("no glibc with malloc USDT probes (system libc has none, ../shared/glibc-sdt absent)")
    from pymtrace.tracee import libc

    if d == "system":
        return [], libc.system_libc()
    return [os.path.join(d, "ld-linux-x86-64.so.2"), "--library-path", d], os.path.join(d, "libc.so.6")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cbuild")


@pytest.fixture(scope="session")
def cbuild(build_dir):
    """cbuild("name", *extra_flags) compiles tests/support/workloads/name.c and returns the binary path.

    -fno-builtin keeps gcc from eliding malloc/free pairs; frame pointers keep stacks usable.
    """
    if shutil.which("gcc") is None:
        missing_or_fail("gcc is not installed")

    @functools.lru_cache(maxsize=None)
    def build(name, *flags):
        src = WORKLOADS / f"{name}.c"
        out = build_dir / (name + ("-" + "-".join(f.strip("-").replace("=", "_") for f in flags) if flags else ""))
        cmd = [
            "gcc",
            "-O1",
            "-g",
            "-fno-builtin",
            "-fno-omit-frame-pointer",
            "-pthread",
            "-I",
            str(WORKLOADS),
            "-o",
            str(out),
            str(src),
            *flags,
        ]
        subprocess.run(cmd, check=True)
        return str(out)

    return build


# ---------------------------------------------------------------- exporter (tests/support/exporter.py)


@pytest.fixture
def served():
    """make(sources, **kw) -> an exporter HTTP(S) server in a thread (support.exporter.ServedExporter),
    closed after the test."""
    from support.exporter import ServedExporter

    made = []

    def make(*a, **kw):
        s = ServedExporter(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A directory with cert.pem, key.pem and web.yml (TLS + basic auth prom:s3cret)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    from support.exporter import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def cxx_calls(tmp_path_factory):
    """The C++ workload (support.cxxcalls), built once per test module."""
    from support import cxxcalls

    return cxxcalls.build(tmp_path_factory.mktemp("cxx"))


@pytest.fixture
def tmux(tmp_path):
    """A tmux server of its own (support.tui.Tmux) for a full-screen UI, killed after the test."""
    from support.tui import Tmux

    t = Tmux(tmp_path)
    yield t
    t.kill()


@pytest.fixture(scope="session")
def sim():
    """The native simulator built for the tests (support.replay.simulator)."""
    from support.replay import simulator

    return simulator()


@pytest.fixture
def collector(tmp_path):
    """make(*extra) -> a real `pymtrace collect` process on tmp_path/ds
    (support.collect.CollectorProcess), stopped after the test."""
    from support.collect import collectors

    with collectors(tmp_path / "ds") as make:
        yield make
