"""The record --stacks file parts without BPF: the stack table's format (write, read back,
corrupt input refused with one line), the stack id in mtrace-bin records (MAGIC mark) and in
Parquet (stack_id column), and dump's stack output."""

import io
import os

import pytest
from support.cli import run_pymtrace

from pymtrace.errors import CorruptFile
from pymtrace.trace import stacktable
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.tracee.unwind import Frame, Module

EXE = Module("/usr/bin/prog", "ab12")
LIBC = Module("/usr/lib/libc.so.6", "cd34")
NAMES = {(EXE, 0x10): "main", (EXE, 0x20): "leaf", (LIBC, 0x30): "malloc"}


def symbolize(loc):
    return [Frame(NAMES[loc], "prog.c" if loc[0] is EXE else "", 7)]


def write_table(path, stacks):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w = stacktable.TableWriter(fd, "t", 42, symbolize)
    ids = [w.intern(s, True) for s in stacks]
    w.close()
    return ids


def test_table_round_trip_and_interning(tmp_path):
    a = ((LIBC, 0x30), (EXE, 0x20), (EXE, 0x10))  # leaf first
    b = ((LIBC, 0x30), (EXE, 0x10))
    ids = write_table(tmp_path / "t.stacks", [a, b, a])
    assert ids == [1, 2, 1]
    table = stacktable.read_table(str(tmp_path / "t.stacks"))
    assert table[1].folded() == "main;leaf;malloc"  # root to leaf
    assert table[1].frames[-1].module == LIBC.path and table[1].frames[-1].build_id == "cd34"
    assert table[1].frames[0].offset == 0x10 and table[1].frames[0].file == "prog.c"
    assert table[2].folded() == "main;malloc"


def test_python_frames_kept_and_marked(tmp_path):
    """A merged stack's Python frames: marked "python", named by qualname, file and line, no
    module; equal merged stacks share an id; a line without the key (a native frame, a table
    written before Python frames existed) reads as native."""
    py = Module("[python]", "")
    names = {(py, 0): Frame("leaf_a", "/w/py_chains.py", 41, python=True)}

    def merged_symbolize(loc):
        return [names[loc]] if loc in names else symbolize(loc)

    fd = os.open(tmp_path / "t.stacks", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    w = stacktable.TableWriter(fd, "t", 42, merged_symbolize)
    stack = ((LIBC, 0x30), (py, 0), (EXE, 0x10))
    assert [w.intern(stack, True), w.intern(stack, True)] == [1, 1]
    w.close()
    text = (tmp_path / "t.stacks").read_text()
    assert '"python":true' in text and text.count('"python"') == 1
    frames = stacktable.read_table(str(tmp_path / "t.stacks"))[1].frames
    assert [(f.function, f.python) for f in frames] == [("main", False), ("leaf_a", True), ("malloc", False)]
    assert (frames[1].file, frames[1].line, frames[1].module, frames[1].offset) == ("/w/py_chains.py", 41, "", 0)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"{}\n",
        b'{"format":"pymtrace-stacks","version":2}\n',
        b'{"format":"pymtrace-stacks","version":1}\n{"id":2,"complete":true,"frames":[]}\n',
        b'{"format":"pymtrace-stacks","version":1}\n{"id":1}\n',
        b'{"format":"pymtrace-stacks","version":1}\nnot json\n',
    ],
)
def test_corrupt_table_one_error(text):
    with pytest.raises(CorruptFile):
        stacktable.parse_table(io.BytesIO(text), "t.stacks")


def stacks_trace(path):
    """A MAGIC marked for stacks, a malloc with stack 2, its free."""
    recs = [B.magic_record(7, stacks=True)]
    malloc = B.pack(B.Record(7, B.MALLOC, 0, 0x1000, 16, 0, 32, 5, 0x400))
    word = int.from_bytes(malloc[4:8], "little") | 2 << 8
    recs.append(malloc[:4] + word.to_bytes(4, "little") + malloc[8:])
    recs.append(B.pack(B.Record(7, B.FREE, 0x1000, 0, 0, 32, 0, 6, 0x400)))
    path.write_bytes(b"".join(recs))


def test_mtrace_bin_stack_ids_and_dump(tmp_path):
    trace = tmp_path / "t"
    stacks_trace(trace)
    assert [(r.type, r.stack, r.path) for r in B.read_file(trace)] == [(B.MALLOC, 2, 0), (B.FREE, 0, 0)]
    write_table(tmp_path / "t.stacks", [((EXE, 0x10),), ((LIBC, 0x30), (EXE, 0x20), (EXE, 0x10))])
    out = run_pymtrace("dump", "--stacks", trace, check=True).stdout
    lines = out.splitlines()
    assert "stack=2" in lines[0] and lines[1].split()[0] == "malloc" and lines[3].split()[0] == "main"
    stats = run_pymtrace("dump", "--stats", trace, check=True).stdout
    assert "main;leaf;malloc" in stats
    # the same ids through Parquet and back
    pq = tmp_path / "t.parquet"
    run_pymtrace("convert", trace, pq, "--to", "parquet", check=True)
    import pyarrow.parquet

    assert pyarrow.parquet.read_table(pq).column("stack_id").to_pylist() == [2, 0]
    back = tmp_path / "back"
    run_pymtrace("convert", pq, back, "--to", "mtrace-bin", check=True)
    assert back.read_bytes() == trace.read_bytes()
    missing = run_pymtrace("dump", "--stacks", back)
    assert missing.returncode == 1 and "no stack table" in missing.stderr


def test_stacks_refused_for_text_logs(tmp_path):
    proc = run_pymtrace("record", "--stacks", "--format", "mtrace-text", "-o", tmp_path / "log", "--", "true")
    assert proc.returncode == 1 and "--stacks needs" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.listdir(tmp_path)
