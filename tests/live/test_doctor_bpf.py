"""`pymtrace doctor`: real checks on this machine (root, BPF), and a real requirement
simulated missing; the rest is tests/unit/test_doctor.py."""

import json
import os
import subprocess

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.doctor import doctor_json
from support.uprobes import ProbeWatch

REQUIRED_IDS = {
    "root",
    "bpf",
    "tracefs",
    "uprobes",
    "headers",
    "bcc",
    "smoke",
    "ringbuf",
    "kmem:kmem_cache_alloc",
    "kmem:kmem_cache_free",
    "exceptions:page_fault_user",
    "exceptions:page_fault_kernel",
}


# The smoke test's uprobe is attached for milliseconds only: too briefly to sample it from
# outside. This sitecustomize reports, right after each attach_uprobe, the BPF programs
# the doctor process then holds through perf-event uprobes (bpftool perf list).
HELD_REPORTER = '''
import json, os, subprocess, sys
try:
    import bcc
except ImportError:
    bcc = None
if bcc is not None and hasattr(bcc, "BPF"):
    _attach = bcc.BPF.attach_uprobe

    def _reporting_attach(self, *args, **kw):
        result = _attach(self, *args, **kw)
        out = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True).stdout
        ids = [e["prog_id"] for e in json.loads(out or "[]")
               if e.get("pid") == os.getpid() and e.get("fd_type") in ("uprobe", "uretprobe")]
        print("probecheck: held " + " ".join(map(str, ids)), file=sys.stderr, flush=True)
        return result

    bcc.BPF.attach_uprobe = _reporting_attach
'''


@pytest.mark.bpf
def test_doctor_passes_here_with_every_check_real(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYMTRACE_DOCTOR_SIMULATE_MISSING"}
    (tmp_path / "sitecustomize.py").write_text(HELD_REPORTER)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        PYMTRACE + ["doctor", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    watch = ProbeWatch(proc.pid).follow(proc)  # checks bpftool is there; samples what it can
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    for line in err.splitlines():
        if line.startswith("probecheck: held "):
            watch.prog_ids.update(int(i) for i in line.split()[2:])
    assert watch.prog_ids, f"the smoke test's uprobe was never seen attached: {err}"
    doc = json.loads(out)
    assert doc["ok"] is True and doc["missing"] == []
    by_id = {}
    for c in doc["checks"]:
        by_id.setdefault(c["id"], c)
    assert REQUIRED_IDS <= set(by_id)
    for cid in REQUIRED_IDS:
        assert by_id[cid]["status"] == "ok", by_id[cid]
        assert by_id[cid]["required"] is True
    # kprobes are informational only: this kernel has none and that is fine
    assert by_id["kprobes"]["required"] is False and by_id["kprobes"]["status"] == "info"
    # the smoke test really compiled, attached, saw events and detached
    smoke = by_id["smoke"]["detail"]
    assert "compiled+loaded" in smoke and "detached" in smoke
    assert "getpid: 0 hits" not in smoke
    # the system libc is listed with its malloc USDT probe count
    libcs = [c for c in doc["checks"] if c["id"] == "libc"]
    assert libcs and "malloc USDT probes" in libcs[0]["detail"]
    # no uprobe of the doctor process is left behind
    watch.assert_gone()


@pytest.mark.bpf
def test_doctor_table_output_here():
    proc = run_pymtrace("doctor")
    assert proc.returncode == 0
    out = proc.stdout
    for name in (
        "root / capabilities",
        "BPF syscall",
        "BPF JIT",
        "BTF",
        "tracefs mounted",
        "uprobes",
        "tracepoint kmem:kmem_cache_alloc",
        "kprobes (not needed)",
        "kernel headers for BCC",
        "BCC compile/load/attach smoke test",
        "system libc",
        "BPF ring buffer",
    ):
        assert name in out
    assert "pymtrace can run here" in out


@pytest.mark.bpf
def test_simulated_missing_via_hidden_flag_only_that_fails():
    env = {k: v for k, v in os.environ.items() if k != "PYMTRACE_DOCTOR_SIMULATE_MISSING"}
    proc, doc = doctor_json("--simulate-missing", "ringbuf,exceptions:page_fault_user", env=env)
    assert proc.returncode == 1
    assert sorted(doc["missing"]) == ["exceptions:page_fault_user", "ringbuf"]
    rb = [c for c in doc["checks"] if c["id"] == "ringbuf"][0]
    assert rb["status"] == "MISSING" and "5.8" in rb["fix"]
    # hidden: not in --help
    assert "simulate" not in run_pymtrace("doctor", "--help").stdout


@pytest.mark.bpf
def test_smoke_check_reports_a_uprobe_left_attached(monkeypatch):
    """The smoke test's leftover check is not hollow: with detaching skipped, the uprobe BCC
    attached (a perf-event descriptor, invisible in tracefs's uprobe_events) is reported."""
    from pymtrace.bpf import load as bpfload
    from pymtrace.commands import doctor

    tracepoints = {"exceptions:page_fault_user", "kmem:kmem_cache_alloc"}
    assert bpfload.own_perf_event_fds() == []
    kept = []
    monkeypatch.setattr(bpfload, "detach_all", kept.append)
    try:
        check = doctor.check_smoke(frozenset(), True, tracepoints)
        assert check.status == doctor.MISSING
        assert "left attached" in check.detail
    finally:
        monkeypatch.undo()
        for b in kept:
            bpfload.detach_all(b)
    assert bpfload.own_perf_event_fds() == []
    assert doctor.check_smoke(frozenset(), True, tracepoints).status == doctor.OK


@pytest.mark.bpf
def test_doctor_reports_the_slab_fallback_of_a_kernel_without_cache_names(tmp_path):
    """The kernel's own tracepoint format decides (emulated here: 6.1's kmem_cache_alloc has no
    `name`); doctor names the fallback in use and still passes."""
    from support.slab_formats import FORMAT_ALLOC_NO_NAME

    d = tmp_path / "kmem" / "kmem_cache_alloc"
    d.mkdir(parents=True)
    (d / "format").write_text(FORMAT_ALLOC_NO_NAME)
    # without BTF: with it the slab program reads the caches from BTF, whatever the formats say
    env = dict(os.environ, PYMTRACE_FAKE_TP_FORMAT_DIR=str(tmp_path), PYMTRACE_FAKE_BTF=str(tmp_path / "no-btf"))
    env.pop("PYMTRACE_DOCTOR_SIMULATE_MISSING", None)
    proc, doc = doctor_json(env=env)
    assert proc.returncode == 0, proc.stderr
    by_id = {c["id"]: c for c in doc["checks"]}
    slab = by_id["slab-source"]
    assert slab["status"] == "info" and slab["required"] is False
    assert "fallback in use, object size via /proc/slabinfo" in slab["detail"]
    assert by_id["uretprobe"]["status"] in ("ok", "info")
    env.pop("PYMTRACE_FAKE_TP_FORMAT_DIR")
    env.pop("PYMTRACE_FAKE_BTF")
    proc, doc = doctor_json(env=env)
    slab = {c["id"]: c for c in doc["checks"]}["slab-source"]
    from pymtrace.bpf import kfeatures

    real = kfeatures.slab_source()  # this kernel's own (6.1: by object size too)
    assert real.source in slab["detail"]
    named = real.source in (kfeatures.SLAB_BY_BTF, kfeatures.SLAB_BY_NAME)
    assert slab["status"] == ("ok" if named and real.frees else "info")
