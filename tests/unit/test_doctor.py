"""`pymtrace doctor` without root or BPF: simulated and real missing requirements, the libc
rows, the capability check (the real checks on this machine: tests/live/test_doctor_bpf.py)."""

import json
import os
import shutil
import subprocess
import time

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.doctor import doctor_json
from support.paths import ROOT


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
        from pymtrace.tracee import libc

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
