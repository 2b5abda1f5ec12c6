"""Helpers for the tests of other allocators than glibc (no tests here): Debian's allocator
libraries (installed by install.sh) found through ldconfig, and `pymtrace exporter` started
and waited for, `pymtrace record -p` around one run of a workload."""

import signal
import subprocess
import time

from support.cli import PYMTRACE
from support.needs import missing_or_fail
from support.top import Lines

LIBS = {  # "a|b": the first ldconfig knows (Debian 13's libmimalloc3 has soname .so.3)
    "jemalloc": "libjemalloc.so.2",
    "tcmalloc": "libtcmalloc_minimal.so.4",
    "mimalloc": "libmimalloc.so.2|libmimalloc.so.3",
}


def library(sonames):
    """The x86-64 path ldconfig knows for SONAMES ("a|b": the first found; missing: a skip, or
    a failure under PYMTRACE_REQUIRE_BPF=1: install.sh installs these)."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for soname in sonames.split("|"):
        for line in out.splitlines():
            if line.strip().startswith(soname + " ") and "x86-64" in line:
                return line.split("=>")[-1].strip()
    missing_or_fail(f"{sonames} is not installed (install.sh installs it)")


def start_exporter(port, *args, timeout=300):
    """`pymtrace exporter --listen 127.0.0.1:PORT --no-bpf-stats ARGS`, once it serves."""
    exp = subprocess.Popen(
        PYMTRACE + ["exporter", "--listen", f"127.0.0.1:{port}", "--no-bpf-stats", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + timeout
    line = ""
    while time.time() < deadline:
        line = exp.stderr.readline()
        if "serving" in line or (not line and exp.poll() is not None):
            break
    if "serving" not in line:
        exp.kill()
        exp.wait()
        raise AssertionError(f"the exporter did not start: {line}")
    return exp


def record_workload(w, out, *extra):
    """record -p W -o OUT, the workload run once recording; the workload's tally."""
    rec = subprocess.Popen(
        PYMTRACE + ["record", "-p", str(w.pid), "-o", str(out), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = Lines(rec.stderr)
    try:
        seen = []
        while not seen or "recording" not in seen[-1]:
            seen.append(err.get(300))
        w.go()
        expected = w.result()
        # stopped before the workload's threads exit (glibc frees their TLS then: real calls
        # the workload's tally does not count)
        rec.send_signal(signal.SIGINT)
        rc = rec.wait(60)
        assert w.finish() == 0
        while True:
            try:
                seen.append(err.get(5))
            except AssertionError:
                break
        assert rc == 0, "".join(seen)
        return expected
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        w.kill()
