"""A real process that names itself with terminal escapes (prctl PR_SET_NAME) and faults on a
file whose path holds some: `top --batch` and the full screen (in tmux) show both escaped,
never acting on them. The escaping itself, every view and report: tests/unit/test_views_escaping.py."""

import subprocess
import sys

import pytest
from support.cli import run_pymtrace
from support.paths import ROOT
from support.tui import Tmux

NAME = "\x1b[2J\x1b]0;PWN\x07X"  # clear the screen, set the window title to PWN, bell
ESCAPED = "\\x1b[2J\\x1b]0;PWN\\x07X"
FILE = "\x1b[31mred\x07.dat"
ESCAPED_FILE = "\\x1b[31mred\\x07.dat"

WORKLOAD = r"""
import ctypes, mmap, os, sys, time
ctypes.CDLL(None, use_errno=True).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
m = mmap.mmap(os.open(sys.argv[2], os.O_RDONLY), 1 << 20, prot=mmap.PROT_READ)
print("ready", flush=True)
while True:
    keep = [bytearray(100000) for _ in range(5)]  # above pymalloc's limit: real malloc calls
    sum(m[i] for i in range(0, 1 << 20, 4096))  # faults on the file, mapped all along
    m.madvise(mmap.MADV_DONTNEED)  # so the next round faults again
    time.sleep(0.05)
"""


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / FILE
    path.write_bytes(b"x" * (1 << 20))
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, NAME, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    with open(f"/proc/{proc.pid}/comm") as f:
        assert f.read() == NAME + "\n"
    yield proc
    proc.kill()
    proc.wait()


def unprintable(text):
    return sorted({c for c in text if not c.isprintable() and c not in "\n"})


@pytest.mark.bpf
def test_batch_prints_a_hostile_comm_and_path_escaped(hostile):
    out = run_pymtrace("top", "--batch", "-p", hostile.pid, "-i", "0.5", "-n", "2", timeout=240, check=True).stdout
    assert unprintable(out) == [], out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(str(hostile.pid))]
    assert rows and all(ESCAPED in line for line in rows), out  # processes, totals, faults, heap
    assert ESCAPED_FILE in out, out  # the faults view's region row


@pytest.mark.bpf
def test_full_screen_shows_a_hostile_comm_escaped(hostile, tmp_path):
    t = Tmux(tmp_path)
    try:
        t.type(f"cd {ROOT} && {sys.executable} -m pymtrace top -p {hostile.pid} -i 0.5")
        s = t.wait_for(
            lambda s: "[1 processes]" in s and ESCAPED in s, "the escaped name", timeout=120, fail_on="pymtrace: error"
        )
        assert "^[" not in s
        t.send("3")  # page faults: the file's path
        t.wait_for(lambda s: "[3 page faults]" in s and ESCAPED_FILE in s, "the escaped path")
        assert "PWN" not in t.run("display-message", "-p", "-t", "t", "#{pane_title}")
        t.send("q")
        t.wait_for(lambda s: not t.alternate_on(), "top's exit", timeout=30)
    finally:
        t.kill()
