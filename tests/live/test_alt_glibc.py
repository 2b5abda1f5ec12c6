"""Optional: exact counts under a second glibc, the workload run through that glibc's loader.

Every probe site is decoded from the libc a process maps (pymtrace/tracee/probesite.py), so
another glibc release means other offsets (glibc 2.41's free(NULL) `ret` is at free+0x188,
2.36's at +0xc8) and other code shapes (2.41's memalign and aligned_alloc are separate
functions). These tests run tests/support/workloads/top_calls.c with the other glibc's
loader and libc and check that `top` and `record` count every call exactly, as
tests/live/test_top_malloc.py does on the system's glibc.

The second glibc: $PYMTRACE_ALT_LIBC_ROOT, either a root file system (a mounted distribution
image: usr/lib/x86_64-linux-gnu/libc.so.6 and the loader under usr/lib64 or lib64) or one
directory holding libc.so.6 and ld-linux-x86-64.so.2; else /work/d13/root (the development
machine's mounted Debian 13 image, glibc 2.41) if it exists. Without one these tests SKIP,
also under PYMTRACE_REQUIRE_BPF=1: CI has no second glibc, and this is an extra check of
decoding on code we do not otherwise see, not a requirement of the suite.
"""

import collections
import os
import signal
import subprocess
import time

import pytest
from support.cli import PYMTRACE
from support.top import Lines, Top, Workload

from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.tracee import libc

pytestmark = pytest.mark.bpf

DEFAULT_ROOT = "/work/d13/root"
LOADER = "ld-linux-x86-64.so.2"
LIB_DIRS = ("", "usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64")
LOADER_DIRS = ("", "usr/lib64", "lib64", "usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")


def _find(root, dirs, name):
    for d in dirs:
        path = os.path.join(root, d, name)
        if os.path.isfile(path):
            return path
    return None


@pytest.fixture
def alt_glibc(cbuild):
    """(run_prefix, libc_path, workload): the top_calls workload and how to run it on the
    second glibc. Skips (never fails) when there is none or the workload cannot run on it."""
    root = os.environ.get("PYMTRACE_ALT_LIBC_ROOT") or (DEFAULT_ROOT if os.path.isdir(DEFAULT_ROOT) else None)
    if root is None:
        pytest.skip("no second glibc: set PYMTRACE_ALT_LIBC_ROOT to a root file system or glibc directory")
    libc_path = _find(root, LIB_DIRS, "libc.so.6")
    loader = _find(root, LOADER_DIRS, LOADER)
    if libc_path is None or loader is None:
        pytest.skip(f"{root}: no libc.so.6 and {LOADER} found under {', '.join(d or '.' for d in LIB_DIRS)}")
    libc_path = os.path.realpath(libc_path)  # the path the process maps
    system = libc.system_libc()
    if system and os.path.samefile(libc_path, system):
        pytest.skip(f"{libc_path} is the system libc, not a second glibc")
    prefix = [loader, "--library-path", os.path.dirname(libc_path)]
    workload = cbuild("top_calls")
    # a built program may need symbol versions an older glibc lacks: then there is nothing to test
    trial = subprocess.run(prefix + [workload], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    if not trial.stdout.startswith("ready "):
        pytest.skip(f"the workload does not run on {libc_path}: {trial.stderr.strip()[:300]}")
    return prefix, libc_path, workload


def test_alt_glibc_top_counts_every_call_once_exactly(alt_glibc):
    prefix, libc_path, workload = alt_glibc
    w = Workload(prefix + [workload])
    top = Top("--json", "-p", w.pid, "-i", "0.5", "--no-glibc")
    try:
        assert libc.process_libc(w.pid) == libc_path
        top.json_doc()  # printed right after attach
        w.go()
        expected = w.result()
        assert expected["calls"]["free_null"] > 0 and expected["calls"]["realloc"] > 0
        doc = top.json_after(time.monotonic())
        p = doc["snapshot"]["processes"][str(w.pid)]
        assert p["calls"] == expected["calls"]
        for key in ("requested_bytes", "allocated_bytes", "freed_bytes", "failed", "size_log2"):
            assert p[key] == expected[key], key
        assert top.stop(signal.SIGINT) == 0
        top.watch.assert_gone()
        assert w.finish() == 0
    finally:
        top.kill()
        w.kill()


def test_alt_glibc_record_has_one_record_per_call(alt_glibc, tmp_path):
    prefix, libc_path, workload = alt_glibc
    out = tmp_path / "alt.trace"
    w = Workload(prefix + [workload])
    rec = subprocess.Popen(PYMTRACE + ["record", "-p", str(w.pid), "-o", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        err = Lines(rec.stderr)
        while "pymtrace: recording" not in err.get(90):  # printed once every probe is attached
            pass
        w.go()
        expected = w.result()
        time.sleep(0.3)  # a few poll intervals: the last records reach the file
        rec.send_signal(signal.SIGINT)
        assert rec.wait(timeout=60) == 0
        records = list(B.read_file(out))
        counts = collections.Counter(r.type_name for r in records)
        calls = dict(expected["calls"])
        free_null = calls.pop("free_null")
        assert dict(counts) == calls
        assert sum(1 for r in records if r.type == B.FREE and r.ptr1 == 0) == free_null
        assert w.finish() == 0
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        w.kill()
