"""Contracts defined once in a C header and read by Python: what Python reads is what gcc sees."""

import json
import re
import shutil
import struct
import subprocess
import sys

import pytest
from support.paths import ROOT

from pymtrace.bpf import structs
from pymtrace.replay import runner as replay
from pymtrace.trace.formats import wl

NATIVE = ROOT / "pymtrace" / "replay" / "native"


def _gcc(tmp_path, name, lines, include):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is not installed")
    src = tmp_path / f"{name}.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / name
    subprocess.run(["gcc", "-Wall", "-Werror", "-I", str(include), "-o", str(exe), str(src)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()


def test_wl_header_constants_python_reads_equal_what_gcc_compiles(tmp_path):
    """pymtrace/replay/native/wl.h (included by replay.c) is the only definition of the .wl opcodes,
    their argument counts, the simulator's call names, mallopt parameters, exit codes and
    limits: every constant Python parses from it has gcc's value, no numeric macro is missed,
    formats/wl.py and replay/runner.py hold exactly what the C tables built from it hold, and
    each mallopt parameter is <malloc.h>'s."""
    h = structs.native_header("wl")
    macros = subprocess.run(
        ["gcc", "-dM", "-E", str(NATIVE / "wl.h")], capture_output=True, text=True, check=True
    ).stdout
    object_like = {m for m in re.findall(r"^#define (WL_\w+) \S", macros, re.M)}
    assert set(h.consts) == object_like  # every value macro of wl.h is a constant Python reads

    prog = [
        "#include <malloc.h>",
        "#include <stdio.h>",
        '#include "wl.h"',
        '#define OP(op) printf("op %d %s %d\\n", WL_OP_##op, #op, WL_NARGS_##op);',
        '#define CALL(c) printf("call %d %s\\n", WL_CALL_##c, #c);',
        '#define MALLOPT(n) printf("mallopt M_%s %d %d\\n", #n, WL_MALLOPT_##n, M_##n);',
        "int main(void) {",
    ]
    prog += [f'printf("const {n} %lld\\n", (long long)({n}));' for n in sorted(h.consts)]
    prog += ["WL_OPS(OP) WL_CALLS(CALL) WL_MALLOPTS(MALLOPT) return 0; }"]
    out = _gcc(tmp_path, "wl_consts", prog, NATIVE)

    c_consts = {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("const ")}
    assert c_consts == h.consts
    c_ops = [line.split()[1:] for line in out if line.startswith("op ")]
    assert wl.OP_NAMES == {int(num): name for num, name, _ in c_ops}
    assert wl.NARGS == {int(num): int(n) for num, _, n in c_ops}
    assert sorted(wl.OP_NAMES) == list(range(c_consts["WL_NOPS"]))
    assert {name: getattr(wl, name) for name in wl.OP_NAMES.values()} == {name: int(num) for num, name, _ in c_ops}
    c_calls = sorted((int(num), name) for num, name in (line.split()[1:] for line in out if line.startswith("call ")))
    assert replay.CALL_TYPES == [name for _, name in c_calls]
    assert [num for num, _ in c_calls] == list(range(c_consts["WL_NCALLS"]))
    assert (wl.MAX_THREADS, wl.MAX_TABLE, wl.MAX_ALIGN) == (
        c_consts["WL_MAX_THREADS"],
        c_consts["WL_MAX_TABLE"],
        c_consts["WL_MAX_ALIGN"],
    )
    assert set(replay.EXIT_MEANING) == {c_consts[f"WL_EXIT_{n}"] for n in ("INVALID", "DEADLOCK", "RESOURCE")}
    c_mallopts = [line.split()[1:] for line in out if line.startswith("mallopt ")]
    assert len(c_mallopts) == c_consts["WL_NMALLOPTS"]
    assert replay.MALLOPT_PARAMS == {name: int(wl_value) for name, wl_value, _ in c_mallopts}
    assert all(wl_value == glibc_value for _, wl_value, glibc_value in c_mallopts), c_mallopts  # <malloc.h>'s
    assert replay.MALLOPT_NAMES == set(replay.MALLOPT_PARAMS)


def test_simulator_knows_every_mallopt_name_python_accepts(tmp_path, monkeypatch):
    """replay.c's --mallopt table is built from wl.h: the compiled simulator maps each name
    `pymtrace replay` accepts to the parameter number Python read from wl.h."""
    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    sim = replay.simulator_path()
    path = tmp_path / "empty.wl"
    path.write_bytes(wl.build(2, 1, [bytes((wl.DONE,))]))
    report = tmp_path / "report.json"
    cmd = [sim, "--json", str(report)]
    for name in sorted(replay.MALLOPT_PARAMS):
        cmd += ["--mallopt", f"{name}=0"]
    subprocess.run([*cmd, str(path)], check=True, capture_output=True, timeout=60)
    got = {m["name"]: m["param"] for m in json.loads(report.read_text())["mallopt"]}
    assert got == replay.MALLOPT_PARAMS


def test_simulator_is_rebuilt_when_the_contract_changes(tmp_path, monkeypatch):
    """The simulator cache is keyed by replay.c AND wl.h (a stale build would disagree with
    Python about the opcodes)."""
    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    first = replay.simulator_path()
    header = tmp_path / "wl.h"
    header.write_text((NATIVE / "wl.h").read_text() + "/* changed */\n")
    monkeypatch.setattr(replay, "NATIVE_HEADER", str(header))
    second = replay.simulator_path()
    assert first != second


def test_mtrace_bin_layout_is_record_h_as_gcc_compiles_it(tmp_path):
    """formats/mtrace_bin reads and writes the 64-byte record with bpf/record.h's layout and
    call type numbers (what the BPF recorder writes), as gcc lays the struct out."""
    from pymtrace.trace.formats import mtrace_bin as mb

    h = structs.header("record")
    fields = [f for f, _ in h.structs["mtrace_record"]._fields_]
    prog = [
        "#include <linux/types.h>",
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "record.h"',
        "int main(void) {",
        'printf("size %zu\\n", sizeof(struct mtrace_record));',
    ]
    prog += [
        f'printf("field {f} %zu %zu\\n", offsetof(struct mtrace_record, {f}), '
        f"sizeof(((struct mtrace_record *)0)->{f}));"
        for f in fields
    ]
    prog += [f'printf("const {n} %llu\\n", (unsigned long long)({n}));' for n in sorted(h.consts)]
    prog += ["return 0; }"]
    out = [line.split() for line in _gcc(tmp_path, "record_layout", prog, ROOT / "bpf")]
    c_consts = {line[1]: int(line[2]) for line in out if line[0] == "const"}
    assert c_consts == h.consts
    size = int(next(line[1] for line in out if line[0] == "size"))
    assert size == mb.RECORD_SIZE == struct.calcsize("<" + mb.RECORD_FORMAT) == c_consts["RECORD_SIZE"]
    # each field's offset and width in the struct format equal gcc's (pad[2] is two words)
    fmt_fields = [(f, int(off), int(width)) for kind, f, off, width in (line for line in out if line[0] == "field")]
    pos = 0
    codes = iter(mb.RECORD_FORMAT)
    for f, off, width in fmt_fields:
        assert pos == off, f
        n = 0
        while n < width:
            n += struct.calcsize("<" + next(codes))
        assert n == width, f
        pos += width
    assert next(codes, None) is None
    assert {
        name: getattr(mb, name)
        for name in ("UNUSED", "MALLOC", "CALLOC", "FREE", "REALLOC", "MEMALIGN", "VALLOC", "PVALLOC", "POSIX_MEMALIGN")
    } == {n[len("CALL_") :]: v for n, v in c_consts.items() if n.startswith("CALL_") and n != "CALL_MAGIC"}
    assert (mb.MAGIC_TYPE, mb.MAGIC_PTR) == (c_consts["CALL_MAGIC"], c_consts["MAGIC_PTR"])
    assert set(mb.TYPE_NAMES) == {v for n, v in c_consts.items() if n.startswith("CALL_") and n != "CALL_UNUSED"}

    # a record packed by mtrace_bin reads back field by field through the header's struct
    rec = mb.Record(-7, mb.POSIX_MEMALIGN, 0x1111, 0x2222, 3, 4, 5, ts_ns=6, caller=0x7777, path=0x2A)
    raw = h.structs["mtrace_record"].from_buffer_copy(mb.pack(rec))
    assert (raw.thread, raw.type, raw.ptr1, raw.ptr2, raw.size, raw.size2, raw.size3, list(raw.pad)) == (
        -7,
        mb.POSIX_MEMALIGN | 0x2A << 8,
        0x1111,
        0x2222,
        3,
        4,
        5,
        [6, 0x7777],
    )


def test_call_names_shown_are_the_ones_the_sources_emit():
    """top and the views list the snapshot's call names once (snapshot.CALLS); they are exactly
    the names snapshot.call_names() reads from the BPF headers (no aligned_alloc: glibc's
    aligned_alloc is memalign and counted there)."""
    from pymtrace.sinks import views
    from pymtrace.sources import snapshot

    emitted = snapshot.call_names()
    assert len(set(snapshot.CALLS)) == len(snapshot.CALLS)
    assert set(snapshot.CALLS) == set(emitted.values())
    assert [k for k, _ in views.TOTAL_COLUMNS if k in emitted.values()] == list(snapshot.CALLS)
    # C++'s operator delete variants release blocks like free
    deletes = {"delete", "delete_array", "delete_sized", "delete_aligned"}
    assert set(snapshot.DELETE_CALLS) == deletes
    assert set(views.ALLOC_CALLS) == set(snapshot.CALLS) - {"free", "free_null"} - deletes


def test_installed_layout_reads_the_headers(tmp_path):
    """Installed from a wheel, the headers are package data (pymtrace/bpf/programs/*.h,
    pymtrace/replay/native/*.h): the contracts read from them must be found there too."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "pymtrace", site / "pymtrace", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "bpf", site / "pymtrace" / "bpf" / "programs")
    code = (
        "import pymtrace, sys; from pymtrace.replay import runner as replay; from pymtrace.bpf import structs;"
        " from pymtrace.trace.formats import mtrace_bin, wl;"
        "assert pymtrace.__file__.startswith(sys.argv[1]), pymtrace.__file__;"
        "print(structs.header('malloc_stats').consts['CALL_MALLOC'], mtrace_bin.RECORD_SIZE, wl.MEMALIGN,"
        " replay.CALL_TYPES[-1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "64", "12", "malloc_trim"]


def test_interposer_ring_header_python_reads_equal_what_gcc_compiles(tmp_path):
    """pymtrace/tracee/native/interpose.h (included by interpose.c) is the only definition of
    the interposer's ring, its stack table's modules and heap's credits: every constant and
    every field offset Python reads is gcc's, and a ring slot is bpf/record.h's record_event."""
    import ctypes

    h = structs.native_header("interpose", "tracee")
    native = ROOT / "pymtrace" / "tracee" / "native"
    macros = subprocess.run(
        ["gcc", "-dM", "-E", "-include", "linux/types.h", str(native / "interpose.h")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert set(h.consts) == set(re.findall(r"^#define ((?:RING|CREDIT|STACK)_\w+) \S", macros, re.M))
    ring, credits, module = h.structs["ring_header"], h.structs["sample_credits"], h.structs["stack_module"]
    prog = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/types.h>", '#include "interpose.h"']
    prog += ["int main(void) {"]
    prog += [f'printf("const {n} %lld\\n", (long long)({n}));' for n in sorted(h.consts)]
    prog += [f'printf("field {f} %zu\\n", offsetof(struct ring_header, {f}));' for f, _ in ring._fields_]
    prog += [f'printf("credit {f} %zu\\n", offsetof(struct sample_credits, {f}));' for f, _ in credits._fields_]
    prog += [f'printf("module {f} %zu\\n", offsetof(struct stack_module, {f}));' for f, _ in module._fields_]
    prog += ['printf("modsize %zu\\n", sizeof(struct stack_module));']
    prog += ['printf("size %zu\\n", sizeof(struct ring_header));']
    prog += ['printf("credits %zu\\n", sizeof(struct sample_credits)); return 0; }']
    out = _gcc(tmp_path, "ring", prog, native)
    assert {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("const ")} == h.consts
    assert {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("field ")} == {
        f: getattr(ring, f).offset for f, _ in ring._fields_
    }
    assert {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("credit ")} == {
        f: getattr(credits, f).offset for f, _ in credits._fields_
    }
    assert {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("module ")} == {
        f: getattr(module, f).offset for f, _ in module._fields_
    }
    assert f"size {ctypes.sizeof(ring)}" in out and f"credits {ctypes.sizeof(credits)}" in out
    assert f"modsize {ctypes.sizeof(module)}" in out
    assert ctypes.sizeof(structs.header("record").structs["record_event"]) == h.consts["RING_EVENT_SIZE"]
