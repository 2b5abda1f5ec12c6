"""`pymtrace replay` where root or BPF is needed: the trusted simulator cache (files given to
another uid), the end-to-end record -> workload -> replay test under glibc and jemalloc, and
the uprobed-libc warning. The rest is tests/unit/test_replay.py."""

import json
import os

import pytest
from support.cli import run_pymtrace
from support.replay import SIM_TIMEOUT, SINGLE, lib_for, only_result, replay_json, write_trace

from pymtrace.trace.formats import mtrace_bin as mb
from pymtrace.trace.formats import wl


def _plant(path, marker):
    """Replace PATH with a 'simulator' that only leaves MARKER behind if it is ever executed."""
    path.unlink(missing_ok=True)
    path.write_text(f"#!/bin/sh\necho planted > {marker}\nexit 1\n")
    path.chmod(0o755)


@pytest.mark.parametrize(
    "how", ["dir-owned-by-other-uid", "parent-world-writable", "parent-group-writable", "file-owned-by-other-uid"]
)
def test_cached_simulator_not_executed_unless_trusted(tmp_path, how):
    """A simulator in the build cache runs only if it and every directory above it belong to
    this user (or root) and nobody else can write them; else a private build is used."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files to another uid (os.chown)")
    env = dict(os.environ, PYMTRACE_CACHE_DIR=str(tmp_path / "base" / "cache"))
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    run_pymtrace("replay", trace, env=env, check=True, timeout=SIM_TIMEOUT)
    (exe,) = (tmp_path / "base" / "cache" / "native").iterdir()
    marker = tmp_path / "marker"
    _plant(exe, marker)
    if how == "dir-owned-by-other-uid":
        os.chown(exe, 65534, 65534)
        os.chown(exe.parent, 65534, 65534)
    elif how == "parent-world-writable":
        (tmp_path / "base").chmod(0o777)
    elif how == "parent-group-writable":
        (tmp_path / "base").chmod(0o770)
    else:
        os.chown(exe, 65534, 65534)
    proc = run_pymtrace("replay", trace, "--json", env=env, timeout=SIM_TIMEOUT)
    assert not marker.exists(), "the planted simulator was executed"
    assert proc.returncode == 0, proc.stderr
    assert only_result(json.loads(proc.stdout))["calls"]["malloc"]["count"] == 2
    if how == "file-owned-by-other-uid":  # a trusted cache: the file is rebuilt in place
        assert proc.stderr == "" and exe.stat().st_uid == 0 and b"planted" not in exe.read_bytes()
    else:  # nothing in an untrusted cache is touched; one note line says why
        assert b"planted" in exe.read_bytes() and len(list(exe.parent.iterdir())) == 1
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("pymtrace: note: not using the simulator cache")


# -- end to end -------------------------------------------------------------------------
def trace_expectation(path):
    """Per-type call counts the replay must show, straight from the trace."""
    exp = {}
    live = set()
    for rec in mb.read_file(path):
        t = rec.type
        name = {mb.POSIX_MEMALIGN: "memalign"}.get(t, rec.type_name)
        if t == mb.FREE:
            if rec.ptr1 and rec.ptr1 not in live:
                continue
            live.discard(rec.ptr1)
        elif t == mb.REALLOC:
            if rec.ptr2 == 0 and rec.size:
                continue
            live.discard(rec.ptr1)
            if rec.ptr2:
                live.add(rec.ptr2)
        else:
            ok = rec.ptr2 != 0 and not (t == mb.POSIX_MEMALIGN and rec.ptr1)
            if not ok:
                continue
            live.add(rec.ptr2)
        exp[name] = exp.get(name, 0) + 1
    return exp


@pytest.mark.bpf
def test_end_to_end_record_convert_replay_glibc_jemalloc(tmp_path, cbuild):
    exe = cbuild("replay_mt")
    trace = tmp_path / "mt.trace"
    proc = run_pymtrace("record", "-o", trace, "--", exe, "100", timeout=300)
    assert proc.returncode == 0, proc.stderr
    wl_path = tmp_path / "mt.wl"
    conv = run_pymtrace("workload", trace, "-o", wl_path, timeout=300)
    assert conv.returncode == 0, conv.stderr
    assert "inversions unrepaired" not in conv.stdout and "invalid frees" not in conv.stdout, conv.stdout
    parsed = wl.read_file(wl_path)
    assert len(parsed.threads) >= 5  # main + 4 workers
    expected = trace_expectation(trace)
    assert expected["free"] > 1000 and expected["valloc"] >= 4 * 5
    allocators = ["glibc"] + (["jemalloc"] if lib_for("jemalloc") else [])
    if "jemalloc" not in allocators:
        pytest.fail("jemalloc (libjemalloc2) is not installed")
    args = [a for n in allocators for a in ("--allocator", n)]
    doc = replay_json(wl_path, *args)
    for conf in doc["configurations"]:
        assert conf["error"] is None, conf
        r = conf["result"]
        got = {k: v["count"] for k, v in r["calls"].items() if v["count"]}
        assert got == expected, (conf["configuration"], got, expected)
        assert r["threads"] == len(parsed.threads)
        libs = {os.path.realpath(p) for p in r["libraries"]}
        if conf["configuration"] == "jemalloc":
            assert lib_for("jemalloc") in libs
        else:
            assert not any("jemalloc" in p for p in libs)


def _tracefs_write(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # no seek: tracefs files refuse SEEK_END
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@pytest.mark.bpf
def test_uprobed_libc_is_flagged(tmp_path):
    """While a system-wide uprobe sits on libc's malloc (as `pymtrace top`/`exporter` place
    them), glibc times include the traps: the row says so."""
    from pymtrace.bpf import load as bpfload
    from pymtrace.tracee import libc

    bpfload.ensure_tracefs()
    path = os.path.realpath(libc.system_libc())
    off, _ = libc.file_offset(path, libc.symbol(path, "malloc").address)
    # on malloc's second instruction: another tracer may own a probe on its first
    import capstone

    with open(path, "rb") as f:
        f.seek(off)
        code = f.read(16)
    first = next(capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64).disasm(code, 0))
    off += first.size
    events = os.path.join(bpfload.TRACEFS, "uprobe_events")
    name = f"pymtrace_replay_test_{os.getpid()}"
    _tracefs_write(events, f"p:uprobes/{name} {path}:{off:#x}\n")
    enable = os.path.join(bpfload.TRACEFS, "events", "uprobes", name, "enable")
    try:
        _tracefs_write(enable, "1")
        trace = write_trace(tmp_path / "single.trace", SINGLE)
        r = only_result(replay_json(trace))
        assert "malloc" in r["uprobed"].split()
        proc = run_pymtrace("replay", trace, timeout=SIM_TIMEOUT)
        assert "UPROBED: malloc" in proc.stdout
    finally:
        _tracefs_write(enable, "0")
        _tracefs_write(events, f"-:uprobes/{name}\n")
