"""`pymtrace doctor`: real checks on this machine, simulated and real missing requirements."""

import json
import os
import shutil
import subprocess
import time

import pytest
from conftest import PYMTRACE, ROOT, ProbeWatch, run_pymtrace

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


def doctor_json(*args, env=None, **kw):
    proc = run_pymtrace("doctor", "--json", *args, env=env, **kw)
    return proc, json.loads(proc.stdout)


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


def test_simulated_missing_requirement_is_named_and_fails():
    env = dict(os.environ, PYMTRACE_DOCTOR_SIMULATE_MISSING="btf,headers")
    proc = run_pymtrace("doctor", env=env)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    headers_line = [ln for ln in lines if ln.startswith("kernel headers for BCC")][0]
    assert "MISSING" in headers_line and "(simulated)" in headers_line and "install" in headers_line
    btf_line = [ln for ln in lines if ln.startswith("BTF ")][0]
    assert "MISSING" in btf_line
    assert "missing: " in proc.stdout and "kernel headers for BCC" in proc.stdout.split("missing: ")[1]
    # BTF is optional (BCC compiles against the headers): named, but not a reason to fail
    proc, doc = doctor_json(env=env)
    assert proc.returncode == 1
    assert "headers" in doc["missing"] and "btf" not in doc["missing"]
    assert doc["simulated"] == ["btf", "headers"]
    smoke = [c for c in doc["checks"] if c["id"] == "smoke"][0]
    assert smoke["status"] == "skipped"


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


def test_unknown_simulated_name_is_an_error():
    env = dict(os.environ, PYMTRACE_DOCTOR_SIMULATE_MISSING="nonsense")
    proc = run_pymtrace("doctor", env=env)
    assert proc.returncode == 1
    assert "unknown check(s) nonsense" in proc.stderr and proc.stdout == ""


def test_non_root_run_names_root_as_missing():
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is not installed")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *PYMTRACE, "doctor", "--json"]
    else:
        cmd = [*PYMTRACE, "doctor", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "PYMTRACE_DOCTOR_SIMULATE_MISSING"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert "root" in doc["missing"]
    root = [c for c in doc["checks"] if c["id"] == "root"][0]
    assert root["status"] == "MISSING" and "sudo" in root["fix"]
    assert "euid 65534" in root["detail"] or f"euid {os.geteuid()}" in root["detail"]
    smoke = [c for c in doc["checks"] if c["id"] == "smoke"][0]
    assert smoke["status"] == "skipped"


def test_libc_with_probes_in_a_running_process_is_listed(sdt_libc):
    prefix, libc_path = sdt_libc
    sleeper = subprocess.Popen(prefix + ["/bin/sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{sleeper.pid}/maps") as f:
                if os.path.basename(libc_path) in f.read():
                    break
            time.sleep(0.05)
        env = dict(os.environ, PYMTRACE_DOCTOR_SIMULATE_MISSING="smoke")  # skip BCC: only the libc rows matter
        proc, doc = doctor_json(env=env)
        libcs = [c for c in doc["checks"] if c["id"] == "libc"]
        real = os.path.realpath(libc_path)
        row = [c for c in libcs if os.path.realpath(c["detail"].split(":")[0]) == real]
        assert row, libcs
        from pymtrace.target import libc

        n = len(libc.malloc_probes(libc_path))
        assert n > 0 and f"{n} malloc USDT probes" in row[0]["detail"]
        assert row[0]["status"] == "ok" and row[0]["required"] is False
    finally:
        sleeper.kill()
        sleeper.wait()


def test_check_root_reads_capabilities(monkeypatch):
    from pymtrace.commands import doctor

    monkeypatch.setattr(doctor, "_cap_eff", lambda: 1 << doctor.CAP_BPF | 1 << doctor.CAP_PERFMON)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    c = doctor.check_root(set())
    assert c.status == "ok" and "CAP_BPF, CAP_PERFMON" in c.detail
    monkeypatch.setattr(doctor, "_cap_eff", lambda: 0)
    c = doctor.check_root(set())
    assert c.status == "MISSING" and "CAP_SYS_ADMIN" in c.fix


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
    from test_top_slab import FORMAT_ALLOC_NO_NAME

    d = tmp_path / "kmem" / "kmem_cache_alloc"
    d.mkdir(parents=True)
    (d / "format").write_text(FORMAT_ALLOC_NO_NAME)
    env = dict(os.environ, PYMTRACE_FAKE_TP_FORMAT_DIR=str(tmp_path))
    env.pop("PYMTRACE_DOCTOR_SIMULATE_MISSING", None)
    proc, doc = doctor_json(env=env)
    assert proc.returncode == 0, proc.stderr
    by_id = {c["id"]: c for c in doc["checks"]}
    slab = by_id["slab-source"]
    assert slab["status"] == "info" and slab["required"] is False
    assert "fallback in use, object size via /proc/slabinfo" in slab["detail"]
    assert by_id["uretprobe"]["status"] in ("ok", "info")
    env.pop("PYMTRACE_FAKE_TP_FORMAT_DIR")
    proc, doc = doctor_json(env=env)
    slab = {c["id"]: c for c in doc["checks"]}["slab-source"]
    from pymtrace.bpf import kfeatures

    real = kfeatures.slab_source()  # this kernel's own (6.1: by object size too)
    assert real.source in slab["detail"]
    assert slab["status"] == ("ok" if real.source == kfeatures.SLAB_BY_NAME and real.frees else "info")
