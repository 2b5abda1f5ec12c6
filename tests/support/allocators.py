"""Helpers for the tests of other allocators than glibc (no tests here): Debian's allocator
libraries (installed by install.sh) found through ldconfig, and `pymtrace exporter` started
and waited for."""

import subprocess
import time

from conftest import PYMTRACE, missing_or_fail

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
