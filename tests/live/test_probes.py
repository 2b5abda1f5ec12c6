"""`pymtrace probes`: the live stream, through the real CLI, on real BPF."""

import json
import os
import re
import signal
import subprocess

import pytest
from support.cli import PYMTRACE, run_pymtrace, script_background


def _split(stdout):
    """(events from --json lines, the workload's own "key value" lines)."""
    events, facts = [], {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
        elif line.split():
            parts = line.split()
            facts.setdefault(parts[0], []).append(parts[1:])
    return events, facts


@pytest.mark.bpf
def test_probes_json_sbrk_chain_with_filter(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    proc = run_pymtrace("probes", "--json", "-P", "sbrk_*", "--", *prefix, cbuild("glibc_sbrk"), "6", "150000")
    assert proc.returncode == 0, proc.stderr
    events, facts = _split(proc.stdout)
    assert {e["probe"] for e in events} == {"memory_sbrk_more", "memory_sbrk_less"}
    pid = events[0]["pid"]
    assert all(e["pid"] == pid for e in events)
    more = [e["args"] for e in events if e["probe"] == "memory_sbrk_more"]
    less = [e["args"] for e in events if e["probe"] == "memory_sbrk_less"]
    start, grown, final = (int(facts[k][0][0], 16) for k in ("start_brk", "grown_brk", "final_brk"))
    assert more[0]["brk"] == start
    for a, b in zip(more, more[1:]):
        assert a["brk"] + a["size"] == b["brk"]
    assert more[-1]["brk"] + more[-1]["size"] == grown
    assert sum(a["size"] for a in less) == grown - final and less[-1]["new_brk"] == final
    assert f"{len(events)} events shown, 0 lost" in proc.stderr


MALLOPT = {  # param name: (probe, [(new, old, dyn_disabled or None)] in call order)
    "M_MXFAST": ("memory_mallopt_mxfast", [(64, 128, None)]),
    "M_TRIM_THRESHOLD": ("memory_mallopt_trim_threshold", [(300000, 131072, 0)]),
    "M_TOP_PAD": ("memory_mallopt_top_pad", [(65536, 131072, 1)]),
    "M_MMAP_THRESHOLD": ("memory_mallopt_mmap_threshold", [(262144, 131072, 1), (524288, 262144, 1)]),
    "M_MMAP_MAX": ("memory_mallopt_mmap_max", [(1000, 65536, 1)]),
    "M_PERTURB": ("memory_mallopt_perturb", [(0x5A, 0, None), (0, 0x5A, None)]),
    "M_ARENA_TEST": ("memory_mallopt_arena_test", [(4, 8, None)]),
    "M_ARENA_MAX": ("memory_mallopt_arena_max", [(3, 0, None)]),
}


@pytest.mark.bpf
def test_probes_text_every_mallopt_parameter(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    proc = run_pymtrace("probes", "-P", "mallopt*", "--", *prefix, cbuild("glibc_params"), "mallopt")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    called = [ln.split()[1:3] for ln in lines if ln.startswith("mallopt ")]
    entries = [ln for ln in lines if " memory_mallopt param=" in ln]
    assert [ln.split("memory_mallopt ")[1] for ln in entries] == [f"param={p} value={v}" for p, v in called]
    for param, (probe, calls) in MALLOPT.items():
        got = [ln.split(f" {probe} ")[1] for ln in lines if f" {probe} " in ln]
        want = []
        for new, old, dyn in calls:
            args = f"new={new} old={old}" + ("" if dyn is None else f" dyn_disabled={dyn}")
            want.append(args + " cause=mallopt")
        assert got == want, param
    # a stream line: time, PID, TID, comm, probe, args
    first = entries[0].split()
    assert len(first[0]) == 15 and first[1].isdigit() and first[2] == first[1]


@pytest.mark.bpf
def test_probes_dynamic_threshold_and_retries_and_tcache(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    proc = run_pymtrace("probes", "--json", "--", *prefix, cbuild("glibc_params"), "dyn")
    events, facts = _split(proc.stdout)
    dyn = [e for e in events if e["probe"] == "memory_mallopt_free_dyn_thresholds"]
    assert [[e["args"]["mmap_threshold"], e["args"]["trim_threshold"]] for e in dyn] == [
        [int(x) for x in facts["dyn1"][0]],
        [int(x) for x in facts["dyn2"][0]],
    ]
    assert all(e["cause"] == "dynamic" for e in dyn)

    proc = run_pymtrace("probes", "--json", "-P", "*retry", "--", *prefix, cbuild("glibc_retry"))
    events, facts = _split(proc.stdout)
    big = int(facts["malloc"][0][0])
    small = int(facts["small"][0][0], 16)
    by = {}
    for e in events:
        by.setdefault(e["probe"], []).append(e["args"])
    assert {"bytes": big} in by["memory_malloc_retry"]
    assert by["memory_calloc_retry"] == [{"bytes": big}]
    assert by["memory_realloc_retry"] == [{"bytes": big, "oldmem": small}]
    assert by["memory_memalign_retry"] == [{"bytes": big, "alignment": 4096}]
    assert all(a["bytes"] == big for a in by["memory_arena_retry"]) and len(by["memory_arena_retry"]) == 4

    proc = run_pymtrace("probes", "--json", "-P", "tcache*", "--", *prefix, cbuild("glibc_tcache"), "fake", "3")
    events, facts = _split(proc.stdout)
    assert [(e["args"]["entry"], e["args"]["tc_idx"]) for e in events] == [
        (int(p, 16), int(i)) for p, i in facts["scan"]
    ]


@pytest.mark.bpf
def test_probes_real_double_free_is_seen_before_abort(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    proc = run_pymtrace("probes", "--json", "-P", "tcache_double_free", "--", *prefix, cbuild("glibc_tcache"), "real")
    assert proc.returncode == 128 + 6  # the command died of SIGABRT
    assert "double free detected in tcache" in proc.stderr
    events, facts = _split(proc.stdout)
    assert [(e["args"]["entry"], e["args"]["tc_idx"]) for e in events] == [(int(facts["scan"][0][0], 16), 1)]


@pytest.mark.bpf
def test_probes_attach_to_running_pid(sdt_libc, cbuild):
    prefix, _ = sdt_libc
    work = subprocess.Popen(
        prefix + [cbuild("glibc_idle"), "3", "100000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert work.stdout.readline().startswith("ready")
        tracer = subprocess.Popen(
            PYMTRACE + ["probes", "--json", "-p", str(work.pid), "-d", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = tracer.stderr.readline()
        assert "tracing" in line, line + tracer.stderr.read()
        work.stdin.write("go\n")
        work.stdin.flush()
        rest = work.stdout.read()
        work.wait(timeout=30)
        out, err = tracer.communicate(timeout=60)  # ends by itself: its process exited
    finally:
        work.kill()
    assert tracer.returncode == 0, err
    events, _ = _split(out)
    facts = {k: v for k, v in (ln.split() for ln in rest.splitlines())}
    assert {e["pid"] for e in events} == {work.pid}
    top_pad = [e for e in events if e["probe"] == "memory_mallopt_top_pad"]
    assert [e["args"]["new"] for e in top_pad] == [0] and top_pad[0]["cause"] == "mallopt"
    more = [e["args"] for e in events if e["probe"] == "memory_sbrk_more"]
    assert sum(a["size"] for a in more) == int(facts["after_brk"], 16) - int(facts["before_brk"], 16)


@pytest.mark.bpf
def test_probes_says_when_libc_has_no_probes(cbuild):
    from pymtrace.tracee import libc

    system = libc.system_libc()
    if libc.malloc_probes(system):
        pytest.skip("the system libc carries probes")
    proc = run_pymtrace("probes", "--", cbuild("glibc_sbrk"), "1", "1000")
    assert proc.returncode == 1
    assert f"libc {system} has no USDT probes" in proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback


@pytest.mark.bpf
def test_probes_of_a_command_stop_on_sigint_sent_by_a_script(sdt_libc, cbuild):
    """`pymtrace probes -- CMD & ... kill -INT $!` (SIGINT ignored in a script's background
    job, and sent to pymtrace alone): probes stops as on Ctrl-C, prints its closing line and
    ends the command it launched (5 s grace, then SIGTERM) instead of waiting for it forever."""
    prefix, _ = sdt_libc
    with script_background("probes", "--", *prefix, cbuild("record_loop")) as (shell, pid):
        for line in shell.stderr:
            if line.startswith("pymtrace: tracing"):
                break
        os.kill(pid, signal.SIGINT)
        out, err = shell.communicate(timeout=60)
    assert out.rstrip().endswith("rc=143"), out + err  # the command, ended by SIGTERM
    assert "Traceback" not in err
    assert re.search(r"^pymtrace probes: \d+ events shown, 0 lost$", err, re.M), err
