"""pymtrace.tracee.elf: the direct readers agree with pyelftools, and refuse hostile files."""

import os
import pathlib
import struct
import subprocess
import sys

import pytest
from elftools.elf.elffile import ELFFile

from pymtrace.tracee import elf, libc, mallocapi

# libc (.symtab stripped: .dynsym only), the interpreter (symtab present), the Python binary
SYMBOL_FILES = [libc.system_libc(), os.path.realpath(sys.executable)] + [
    str(p) for p in pathlib.Path("/lib64").glob("ld-linux-x86-64.so.2") if p.exists()
]


def test_program_headers_match_pyelftools():
    path = libc.system_libc()
    headers = elf.program_headers(path)
    with open(path, "rb") as f:
        want = [
            (s["p_flags"], s["p_offset"], s["p_vaddr"], s["p_filesz"], s["p_memsz"]) for s in ELFFile(f).iter_segments()
        ]
    assert headers.position_independent
    assert [(s.flags, s.offset, s.vaddr, s.filesz, s.memsz) for s in headers.segments] == want
    loads = [s for s in headers.segments if s.type == elf.PT_LOAD]
    assert elf.image_size(path) == max(s.vaddr + s.memsz for s in loads)


def test_interpreter():
    assert elf.interpreter("/bin/ls").startswith("/")
    assert elf.interpreter(libc.system_libc()) is None or "ld-linux" in elf.interpreter(libc.system_libc())
    assert elf.interpreter("/etc/passwd") is None


def test_hostile_files(tmp_path):
    real = open(libc.system_libc(), "rb").read()
    for name, data in (("empty", b""), ("text", b"hello\n" * 50), ("truncated", real[:100])):
        path = tmp_path / name
        path.write_bytes(data)
        assert elf.program_headers(str(path)) is None or name == "truncated"
        assert elf.image_size(str(path)) == 0
        assert elf.interpreter(str(path)) is None
    # a .dynsym whose string-table link points past the section headers: one readable error
    head = bytearray(real)
    shoff = struct.unpack_from("<Q", head, 40)[0]
    shentsize, shnum = struct.unpack_from("<HH", head, 58)
    for i in range(shnum):
        if struct.unpack_from("<I", head, shoff + i * shentsize + 4)[0] == 11:  # SHT_DYNSYM
            struct.pack_into("<I", head, shoff + i * shentsize + 40, 60000)  # sh_link
    bad = tmp_path / "badlink"
    bad.write_bytes(bytes(head))
    assert "not a readable ELF file" in libc.libc_problem(str(bad))


def test_dynamic_symbols():
    with open(libc.system_libc(), "rb") as f:
        syms = elf.DynamicSymbols(f)
        assert syms.defined("malloc") and syms.defined("free")
        assert not syms.defined("no_such_symbol_here")


def test_malloc_api_table_is_what_the_malloc_source_attaches():
    """The malloc source's MALLOC_PROBES is the table of pymtrace.tracee.mallocapi, spelled in
    BPF program names."""
    from pymtrace.sources.malloc import MALLOC_PROBES as attached

    derived = tuple(
        (f.name, f"ms_{f.call}_entry", ("ms_outer_return" if f.outer else f"ms_{f.call}_return") if f.returns else None)
        for f in mallocapi.FUNCTIONS
    )
    assert derived == tuple(attached)


@pytest.mark.parametrize("path", SYMBOL_FILES, ids=os.path.basename)
def test_bulk_symbol_table_equals_pyelftools(path):
    """elf.symbols reads 64-bit symbol tables in bulk; the table must be what pyelftools'
    per-symbol parse gives (first definition of a name wins, versions stripped)."""
    expected = {}
    with open(path, "rb") as f:
        ef = ELFFile(f)
        for section_name in (".symtab", ".dynsym"):
            section = ef.get_section_by_name(section_name)
            for sym in section.iter_symbols() if section is not None else ():
                if sym["st_value"] and sym.name:
                    name = sym.name.split("@")[0]
                    expected.setdefault(name, elf.Symbol(name, sym["st_value"], sym["st_size"]))
    assert elf.symbols(path) == expected
    assert len(expected) > 10


@pytest.mark.parametrize("path", SYMBOL_FILES, ids=os.path.basename)
def test_symbol_names_equal_pyelftools(path):
    """elf.symbol_names (the bulk read) gives the functions defined and the symbols left
    undefined that pyelftools' per-symbol parse gives, versions stripped."""
    functions, undefined = set(), set()
    with open(path, "rb") as f:
        ef = ELFFile(f)
        for section_name in (".symtab", ".dynsym"):
            section = ef.get_section_by_name(section_name)
            for sym in section.iter_symbols() if section is not None else ():
                name = sym.name.split("@")[0]
                if not name:
                    continue
                if sym["st_shndx"] == "SHN_UNDEF":
                    undefined.add(name)
                elif sym["st_info"]["type"] == "STT_FUNC":
                    functions.add(name)
    names = elf.symbol_names(path)
    assert names == (functions, undefined)
    assert "malloc" in elf.symbol_names(libc.system_libc()).functions
    assert "malloc" in elf.symbol_names(os.path.realpath(sys.executable)).undefined


def test_symbol_names_of_a_program_defining_and_importing(tmp_path):
    src = tmp_path / "p.c"
    src.write_text(
        "#include <stddef.h>\n"
        "void *mallocx(size_t, int);\n"
        "void *malloc(size_t n) { return mallocx(n, 0); }\n"
        "int main(void) { return malloc(1) != 0; }\n"
    )
    lib = tmp_path / "libx.so"
    prog = tmp_path / "p"
    lib_src = tmp_path / "x.c"
    lib_src.write_text("#include <stddef.h>\nvoid *mallocx(size_t n, int f) { (void)n; (void)f; return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(lib_src)], check=True)
    subprocess.run(["gcc", "-o", str(prog), str(src), str(lib)], check=True)
    names = elf.symbol_names(str(prog))
    assert "malloc" in names.functions and "malloc" not in names.undefined
    assert "mallocx" in names.undefined and "mallocx" not in names.functions
    assert "main" in names.functions
