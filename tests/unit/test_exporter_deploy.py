"""The exporter's deploy files in exporters/ (promtool on the config and rules, the systemd
unit, the Kubernetes DaemonSet) and its command line (help text, argument errors)."""

import re
import shutil
import subprocess

from support.exporter import EXPORTERS
from support.prometheus import need_tool

from pymtrace.commands import exporter


def test_promtool_checks_config_and_rules():
    promtool = need_tool("promtool")
    rules = EXPORTERS / "alerts.rules.yml"
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    r = subprocess.run(
        [promtool, "check", "config", str(EXPORTERS / "prometheus.yml")], capture_output=True, text=True, cwd=EXPORTERS
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [promtool, "test", "rules", str(EXPORTERS / "alerts.test.yml")], capture_output=True, text=True, cwd=EXPORTERS
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_systemd_unit_and_daemonset(tmp_path):
    unit = (EXPORTERS / "pymtrace-exporter.service").read_text()
    assert re.search(r"^ExecStart=/usr/local/bin/pymtrace exporter", unit, re.M)
    if shutil.which("systemd-analyze"):
        r = subprocess.run(
            ["systemd-analyze", "verify", str(EXPORTERS / "pymtrace-exporter.service")], capture_output=True, text=True
        )
        problems = [
            line
            for line in r.stderr.splitlines()
            if "pymtrace-exporter.service" in line
            and not re.search(r"not executable|No such file|Failed to prepare filename", line)
        ]
        assert not problems, r.stderr
    import yaml

    docs = [d for d in yaml.safe_load_all((EXPORTERS / "kubernetes-daemonset.yaml").read_text()) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # comm/PIDs of the host's processes, /proc/PID/maps of each libc
    c = pod["containers"][0]
    assert c["securityContext"].get("privileged") is not True  # capabilities, not privileged
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"BPF", "PERFMON", "SYS_RESOURCE"} <= caps
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/lib/modules", "/usr/src"} <= mounts
    assert any(p.get("containerPort") == exporter.DEFAULT_PORT for p in c["ports"])
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_cli_help_and_argument_errors():
    from support.cli import run_pymtrace

    r = run_pymtrace("exporter", "--help")
    assert r.returncode == 0 and "--web-config" in r.stdout and str(exporter.DEFAULT_PORT) in r.stdout
    # per-call uprobes are an explicit opt-in whose cost --help states
    assert "--per-call" in r.stdout and "2 us per malloc+free pair" in " ".join(r.stdout.split())
    r = run_pymtrace("exporter", "--per-call", "--always-on")
    assert r.returncode != 0 and "contradict" in r.stderr and "Traceback" not in r.stderr
    r = run_pymtrace("exporter", "--comm", "(")
    assert r.returncode != 0 and "--comm" in r.stderr
    r = run_pymtrace("exporter", "--listen", "nonsense")
    assert r.returncode != 0
