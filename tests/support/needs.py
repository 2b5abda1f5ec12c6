"""Prerequisites of a test: a missing one skips the test with the reason, or fails it under
PYMTRACE_REQUIRE_BPF=1 (CI, where install.sh provides every prerequisite)."""

import functools
import os

import pytest

from support.paths import ROOT

REQUIRE_BPF = os.environ.get("PYMTRACE_REQUIRE_BPF") == "1"


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
    from pymtrace.bpf import load as bpfload

    try:
        bpfload.ensure_tracefs()
    except Exception as exc:
        return str(exc)
    if not os.path.exists(f"/lib/modules/{os.uname().release}/build"):
        return "no kernel headers for BCC (run ./install.sh)"
    return None


@functools.lru_cache(maxsize=None)
def sdt_libc_dir():
    """A directory with a probe-carrying glibc (+ its loader), or None.

    Found by inspecting ELF notes, never by distro name: the system libc if it carries the
    malloc probes (Fedora, Ubuntu, ...), else $PYMTRACE_SDT_LIBC_DIR, else ../shared/glibc-sdt.
    """
    from pymtrace.tracee import libc

    candidates = [os.environ.get("PYMTRACE_SDT_LIBC_DIR"), str(ROOT.parent / "shared" / "glibc-sdt")]
    system = libc.system_libc()
    if system and len(libc.malloc_probes(system)) > 0:
        return "system"
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "libc.so.6")) and libc.malloc_probes(os.path.join(d, "libc.so.6")):
            return os.path.realpath(d)  # the path processes map (and tools report), links resolved
    return None
