"""Reading CPython from outside (tracee.pyruntime, tracee.pyframes) against the interpreters
themselves: the offset tables against each version's own headers, the line-table decoders
against the interpreter's co_lines() for every instruction, the interpreter found and its code
objects read in a running process, and the merge of Python frames into native stacks."""

import ctypes
import json
import os
import subprocess
import textwrap

import pytest
from support import pychains
from support.paths import WORKLOADS

from pymtrace.bpf import structs
from pymtrace.tracee import pyframes, pyruntime
from pymtrace.tracee.unwind import Module

PYTHONS = pychains.interpreters()
IDS = [name for name, _, _ in PYTHONS]

# pyoffsets.c's names -> Layout's fields
FIELDS = {
    "runtime.interpreters_head": "interpreters_head",
    "interp.next": "interp_next",
    "interp.threads_head": "interp_threads_head",
    "thread.next": "thread_next",
    "thread.interp": "thread_interp",
    "thread.current_frame": "thread_frame",
    "thread.cframe": "thread_frame",
    "thread.frame": "thread_frame",
    "cframe.current_frame": "cframe_current_frame",
    "frame.previous": "frame_previous",
    "frame.code": "frame_code",
    "frame.instr": "frame_instr",
    "frame.flag": "frame_flag",
    "code.filename": "code_filename",
    "code.name": "code_name",
    "code.qualname": "code_qualname",
    "code.linetable": "code_linetable",
    "code.firstlineno": "code_firstlineno",
    "code.code_adaptive": "code_adaptive",
    "unicode.state": "unicode_state",
    "unicode.length": "unicode_length",
    "unicode.hash": "unicode_hash",
    "unicode.ascii_size": "unicode_ascii_size",
    "unicode.compact_size": "unicode_compact_size",
    "bytes.ob_size": "bytes_size",
    "bytes.ob_sval": "bytes_sval",
}


@pytest.fixture(params=PYTHONS, ids=IDS)
def python(request):
    _, path, minor = request.param
    return pychains.python_or_missing(path, minor)


def run(python, code, *args, **kw):
    return subprocess.run([python, "-c", code, *args], capture_output=True, text=True, check=True, **kw).stdout


def layout_of(python):
    """The Layout pymtrace uses for PYTHON, from a process of it (pyruntime.find)."""
    proc = subprocess.Popen([python, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        found = _wait_found(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait()
    assert found is not None and found.problem is None, found
    return found


def _wait_found(pid):
    for _ in range(200):  # until its loader mapped libpython
        found = pyruntime.find(pid)
        if found is not None:
            return found
        subprocess.run(["sleep", "0.01"])
    return None


def test_layout_matches_the_interpreters_headers(python, tmp_path):
    """Every offset pymtrace reads at (the table of its version, or 3.13's _Py_DebugOffsets)
    is the one the interpreter's own headers give (offsetof, compiled against them)."""
    include = run(python, "import sysconfig; print(sysconfig.get_paths()['include'])").strip()
    if not os.path.exists(os.path.join(include, "internal", "pycore_runtime.h")):
        pytest.skip(f"{python}'s internal headers are not installed (its -dev package)")
    exe = tmp_path / "pyoffsets"
    build = subprocess.run(
        ["gcc", "-I", include, "-I", os.path.join(include, "internal"), "-o", exe, WORKLOADS / "pyoffsets.c"],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    offsets = dict(line.split() for line in subprocess.run([exe], capture_output=True, text=True).stdout.splitlines())
    found = layout_of(python)
    layout = found.layout
    assert int(offsets.pop("version")) >> 16 == (found.version[0] << 8 | found.version[1])
    thread_id = offsets.pop("thread.thread_id")  # 3.10 knows its threads by pthread_t only
    checked = {"thread_tid": int(offsets.pop("thread.native_thread_id", thread_id))}
    for name, value in offsets.items():
        checked[FIELDS[name]] = int(value)
    for field, value in checked.items():
        assert getattr(layout, field) == value, (field, getattr(layout, field), value)
    assert found.source == ("_Py_DebugOffsets" if found.version[:2] >= (3, 13) else "table")


LINES_SCRIPT = textwrap.dedent(
    """
    import json, sys
    source = open(sys.argv[1]).read()
    extra = '''
    def many(a,
             b):
        x = [a
             for a in range(3)]
        try:
            y = {k: (v
                     + 1) for k, v in enumerate(x)}
        except (ValueError,
                TypeError):
            pass
        return (lambda q:
                q + 1)(len(y))
    '''
    out = []
    def walk(code):
        lines = {}
        for start, end, line in code.co_lines():
            for offset in range(start, end, 2):
                lines[offset] = line
        out.append([code.co_linetable.hex(), code.co_firstlineno, lines])
        for const in code.co_consts:
            if hasattr(const, "co_lines"):
                walk(const)
    walk(compile(source, sys.argv[1], "exec"))
    walk(compile(extra, "extra", "exec"))
    print(json.dumps(out))
    """
)


def test_line_tables_decode_as_the_interpreter_does(python):
    """line_310 / line_311 give co_lines()'s line for every instruction of every code object
    of a real module (the workload, a function of multi-line expressions)."""
    found = layout_of(python)
    decode = pyframes.line_310 if found.version[:2] == (3, 10) else pyframes.line_311
    codes = json.loads(run(python, LINES_SCRIPT, str(WORKLOADS / "py_chains.py")))
    checked = 0
    for table, first, lines in codes:
        for offset, line in lines.items():
            assert decode(bytes.fromhex(table), first, int(offset)) == (-1 if line is None else line), offset
            checked += 1
    assert checked > 500


def test_interpreter_and_code_objects_read_from_a_process(python):
    """pyruntime.find names the version and finds _PyRuntime where ctypes sees it; a code
    object is read back by its address: qualified name, file, first line."""
    script = textwrap.dedent(
        """
        import ctypes, json, sys
        class Outer:
            def method(self):
                return 1
        runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
        code = Outer.method.__code__
        print(json.dumps([runtime, id(code), code.co_filename, code.co_firstlineno, list(sys.version_info[:3])]))
        sys.stdout.flush()
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen([python, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        runtime, code, filename, first, version = json.loads(proc.stdout.readline())
        found = pyruntime.find(proc.pid)
        assert found.problem is None and found.version == tuple(version) and found.runtime == runtime
        reader = pyframes.PythonProcess(proc.pid, found, pyframes.PythonFrames())
        info = reader.code(code)
        qualname = "method" if found.version[:2] == (3, 10) else "Outer.method"  # 3.10: co_name
        assert (info.qualname, info.filename, info.firstlineno) == (qualname, filename, first)
        assert reader.code(code + 16) is None  # not a code object
        reader.close()
    finally:
        proc.stdin.close()
        proc.wait()


def test_an_old_interpreter_is_refused_with_the_reason():
    old = pychains.pyenv_python("3.9")
    if old is None:
        pytest.skip("no CPython 3.9 under pyenv")
    proc = subprocess.Popen([old, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        found = _wait_found(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait()
    assert found.version[:2] == (3, 9) and "3.10-3.13 only" in found.problem
    assert found.describe().startswith("CPython 3.9.")


def test_a_process_without_python():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert pyruntime.find(proc.pid) is None
    finally:
        proc.kill()
        proc.wait()


def test_block_layout_and_statuses_match_the_bpf_header():
    header = structs.header("heap")
    assert pyframes.FRAME.size == ctypes.sizeof(header.structs["py_frame"])
    assert pyframes.HEAD.size == ctypes.sizeof(header.structs["py_head"])
    for name in ("NONE", "OK", "NO_THREAD", "TRUNCATED", "FAULT"):
        assert getattr(pyframes, name) == header.consts[f"PY_STATUS_{name}"]


def test_compiler_names_are_known_by_their_tag():
    """A code object's name str gone with it: "<module>" is told by the tag the BPF program
    gave it (hash not computed: -1)."""
    data = b"<module>"
    tag = 0xFFFFFFFFFFFFFFFF ^ int.from_bytes(data, "little") ^ len(data)
    assert pyframes.COMPILER_NAMES[tag] == "<module>"


EXE = Module("/usr/bin/python3.12", "")
EXT = Module("/usr/lib/ext.so", "")
LIBC = Module("/usr/lib/libc.so.6", "")
EVAL = 0x100  # the pcs of the evaluation loop in EXE


def test_merge_replaces_each_evaluation_loop_by_its_frames():
    table = pyframes.PythonFrames()
    f = {name: table.location(name, "x.py", 1) for name in ("main", "outer", "cb", "leaf")}
    # leaf first: malloc, the interpreter's allocation path, the loop running cb+leaf (3.11+:
    # one loop, two frames), the interpreter's call into it, an extension, the loop of main+outer
    native = [(LIBC, 1), (EXE, 2), (EXE, EVAL), (EXE, 3), (EXT, 4), (EXE, 5), (EXE, EVAL), (EXE, 6), (LIBC, 7)]
    groups = [(f["leaf"], f["cb"]), (f["outer"], f["main"])]

    def is_eval(loc):
        return loc[1] == EVAL

    def is_interp(loc):
        return loc[0] == EXE

    merged = pyframes.merge(native, groups, is_eval, pyframes.MERGED, is_interp)
    assert merged == ((LIBC, 1), (EXE, 2), f["leaf"], f["cb"], (EXT, 4), f["outer"], f["main"], (LIBC, 7))
    assert pyframes.merge(native, groups, is_eval, pyframes.PYTHON_ONLY) == (f["leaf"], f["cb"], f["outer"], f["main"])
    assert pyframes.merge(native, groups, is_eval, pyframes.NATIVE) == tuple(native)
    # a native stack cut short (one loop seen): the other frames at its root end
    cut = pyframes.merge(native[:4], groups, is_eval, pyframes.MERGED, is_interp)
    assert cut == ((LIBC, 1), (EXE, 2), f["leaf"], f["cb"], f["outer"], f["main"])
    # no Python frames: the native stack as it is
    assert pyframes.merge(native, (), is_eval, pyframes.MERGED, is_interp) == tuple(native)
    assert [table.symbolize(pyframes.PYTHON, loc[1])[0].function for loc in groups[0]] == ["leaf", "cb"]
