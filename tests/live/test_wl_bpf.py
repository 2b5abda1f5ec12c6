"""The native simulator's memory guard inside a memory cgroup of our own (needs root); the
rest of the simulator's input validation is tests/unit/test_wl.py."""

import os
import subprocess
import uuid

import pytest
from support.replay import one_thread, op

from pymtrace.trace.formats import wl


def _memory_cgroup(limit):
    """A fresh memory cgroup limited to LIMIT bytes (v2 under the root, or v1 under ours)."""
    name = f"pymtrace-test-{uuid.uuid4().hex[:12]}"
    mounts = [line.split() for line in open("/proc/self/mountinfo")]
    v2 = next((m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2"), None)
    if v2 and "memory" in open(os.path.join(v2, "cgroup.subtree_control")).read().split():
        path = os.path.join(v2, name)
        os.mkdir(path)
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(limit))
        return path
    v1 = next(m[4] for m in mounts if m[m.index("-") + 1] == "cgroup" and "memory" in m[-1].split(","))
    rel = next(
        line.strip().split(":", 2)[2] for line in open("/proc/self/cgroup") if "memory" in line.split(":")[1].split(",")
    )
    path = os.path.join(v1 + rel, name)
    os.mkdir(path)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    return path


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.fixture(params=["as set", "always"])
def thp(request):
    """Transparent huge pages as this machine has them, then "always" (Debian's and Ubuntu's
    kernels; the project machines have "madvise"), set for the test and put back after it."""
    if request.param == "as set":
        yield
        return
    if not os.path.exists(THP):
        pytest.skip("this kernel has no transparent huge pages")
    with open(THP) as f:
        before = f.read().split("[", 1)[1].split("]", 1)[0]
    with open(THP, "w") as f:
        f.write("always")
    try:
        yield
    finally:
        with open(THP, "w") as f:
            f.write(before)


@pytest.mark.bpf  # needs root (a memory cgroup of our own, the THP setting)
def test_guard_honours_the_cgroup_limit(sim, tmp_path, thp):
    """The guard read MemAvailable only: in a cgroup limited to 64 MiB, 200,000 x
    MEMALIGN(2**30, 1) (or 100 MB of malloc) met the OOM killer instead of a clear error.
    With THP "always" (Debian 12's VM) each of those blocks took a 2 MiB huge page: the
    page-based count let the OOM killer come first at ~30 blocks."""
    cg = _memory_cgroup(64 << 20)

    def enter():
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    n = 200000
    cases = [
        wl.build(n + 1, 0, [b"".join(op(wl.MEMALIGN, i, 1 << 30, 1) for i in range(1, n + 1)) + b"\x01"]),
        one_thread(b"".join(op(wl.MALLOC, i, 10 << 20) for i in range(1, 11)), nptrs=12),
    ]
    try:
        for data in cases:
            path = tmp_path / "big.wl"
            path.write_bytes(data)
            proc = subprocess.run([sim, str(path)], capture_output=True, text=True, timeout=60, preexec_fn=enter)
            assert proc.returncode == 4, (proc.returncode, proc.stderr)
            (line,) = proc.stderr.splitlines()
            assert "more than the" in line and "of cgroup" in line, line
    finally:
        os.rmdir(cg)
