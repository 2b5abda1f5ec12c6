"""pymtrace.tracee.allocators: probe plans for Debian's jemalloc, tcmalloc and mimalloc and
for a malloc defined in an executable, decoded from the real files (no root needed)."""

import subprocess

import pytest
from support.allocators import LIBS, library

from pymtrace.tracee import allocators, libc


def _plan(path, family):
    return {f: probes for f, probes in allocators.probe_plan(path, family)}


@pytest.mark.parametrize("family", sorted(LIBS))
def test_every_allocating_function_has_a_return_probe_and_each_address_is_probed_once(family):
    path = library(LIBS[family])
    plan = _plan(path, family)
    assert "malloc" in plan and "free" in plan and "calloc" in plan and "realloc" in plan
    from pymtrace.tracee import elf

    syms = elf.symbols(path)
    addresses = [syms[f].address for f in plan]
    assert len(addresses) == len(set(addresses))  # aliases (malloc = tc_malloc, ...) once
    for function, probes in plan.items():
        kinds = [p.kind for p in probes]
        call = next(f.call for f in allocators.FAMILIES[family] if f.name == function)
        if call != "free":
            assert "return" in kinds, function
        assert all(p.program.startswith("ms_f_") for p in probes)


def test_names_sharing_an_address_are_probed_under_the_first_table_name():
    plan = _plan(library(LIBS["tcmalloc"]), "tcmalloc")
    assert "malloc" in plan and "tc_malloc" not in plan and "tc_free" not in plan


def test_forwarders_through_the_plt_are_not_probed():
    # mimalloc: posix_memalign is `jmp mi_posix_memalign@plt`, mi_free_size `jmp mi_free@plt`
    plan = _plan(library(LIBS["mimalloc"]), "mimalloc")
    assert "mi_posix_memalign" in plan and "posix_memalign" not in plan
    assert "free" in plan and "mi_free_size" not in plan and "mi_free_aligned" not in plan


def test_jemalloc_extra_functions_and_their_call_types():
    plan = _plan(library(LIBS["jemalloc"]), "jemalloc")
    assert {p.program for p in plan["mallocx"] if p.kind == "entry"} == {"ms_f_malloc_s1"}
    assert {p.program for p in plan["xallocx"] if p.kind == "entry"} == {"ms_f_realloc_x"}
    assert {p.program for p in plan["sdallocx"]} == {"ms_f_free_p1"}


def test_family_of_an_allocator():
    assert libc.Allocator("glibc", True, "/lib/libc.so.6").family == "glibc"
    assert libc.Allocator("jemalloc", False, "/x/libjemalloc.so.2").family == "jemalloc"
    assert libc.Allocator("its own malloc in app", False, "/x/app").family == "generic"
    assert libc.Allocator("static binary (no shared libc)", False, "/x/app").family is None
    assert libc.Allocator("AddressSanitizer", False, "/x/libasan.so").family is None
    assert allocators.family_of("its own malloc in app") == "generic"


def own_malloc(tmp_path, free):
    """An executable with a malloc of its own (a bump allocator) and FREE, its free's C
    definition, calling free(malloc(1)) once."""
    src = tmp_path / "own.c"
    src.write_text(
        "#include <stddef.h>\n"
        "static char a[1 << 20]; static size_t n;\n"
        "__attribute__((noipa)) void *malloc(size_t s) { void *p = a + n; n += (s + 15) & ~15UL; return p; }\n"
        f"{free}\n"
        "int main(void) { free(malloc(1)); return 0; }\n"
    )
    exe = tmp_path / "own"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src)], check=True)
    return str(exe)


def test_a_malloc_defined_in_the_executable(tmp_path):
    exe = own_malloc(tmp_path, "__attribute__((noipa)) void free(void *p) { (void)p; }")
    plan = _plan(exe, "generic")
    assert set(plan) == {"malloc", "free"}
    assert [p.program for p in plan["free"]] == ["ms_f_free_p1"]


@pytest.mark.parametrize("family", sorted(LIBS) + ["c++"])
def test_programs_before_the_compile_are_exactly_those_the_plan_attaches(family):
    """allocators.programs (read before the BPF compile, which includes only these) equals
    the programs of the probe plan decoded beside it, for each allocator and its C++
    operator new/delete: nothing attached is missing, nothing compiled is left unused."""
    for name in sorted(LIBS) if family == "c++" else [family]:
        path = library(LIBS[name])
        attached = {p.program for _, probes in allocators.probe_plan(path, family) for p in probes}
        assert allocators.programs(path, family) == attached, name
        cxx_entries = allocators.CXX_PROGRAMS - {"ms_f_return"}
        assert attached <= allocators.CXX_PROGRAMS if family == "c++" else not attached & cxx_entries
    # layouts differ between allocators: jemalloc's do not include mimalloc's count * size malloc
    if family == "jemalloc":
        assert "ms_f_malloc_n1s2" not in allocators.programs(library(LIBS["jemalloc"]), "jemalloc")


def test_programs_of_a_free_calling_another_probed_function(tmp_path):
    """A free-type function that calls another probed one gets the nesting program (and a
    return probe): known before the compile from its code."""
    exe = own_malloc(
        tmp_path, "void *volatile kept;\n__attribute__((noipa)) void free(void *p) { if (!p) kept = malloc(0); }"
    )
    attached = {p.program for _, probes in allocators.probe_plan(exe, "generic") for p in probes}
    assert allocators.programs(exe, "generic") == attached == {"ms_f_malloc_s1", "ms_f_free_nest", "ms_f_return"}


def test_a_free_forwarding_through_a_pointer_is_nested(tmp_path):
    """An interposer's free ending in a call through a pointer (dlsym(RTLD_NEXT)'s next free)
    may reach glibc's free, which `record -- CMD` probes beside it: it keeps the nesting depth
    (a return probe), so that the call is recorded once."""
    exe = own_malloc(
        tmp_path, "void (*volatile next_free)(void *);\n__attribute__((noipa)) void free(void *p) { next_free(p); }"
    )
    plan = _plan(exe, "generic")
    assert {p.program for p in plan["free"]} == {"ms_f_free_nest", "ms_f_return"}
    assert allocators.programs(exe, "generic") == {"ms_f_malloc_s1", "ms_f_free_nest", "ms_f_return"}


def _entries_of_bpf_allocators_h():
    """{name: (macro, CALL_* type)} of bpf/allocators.h's entry programs; each entry's #if guard
    names the entry it guards, with the want macro of its list."""
    import re

    from pymtrace.bpf.load import bpf_dir

    text = (bpf_dir() / "allocators.h").read_text()
    found = re.findall(r"^#if (AL_\w*WANT)\((\w+)\).*\n(AL_\w*ENTRY)\((\w+), (CALL_\w+),", text, re.M)
    assert len(found) == len(re.findall(r"^AL_\w*ENTRY\(", text, re.M))  # every entry under its guard
    for want, guarded, macro, name, _ in found:
        assert (guarded, want) == (name, macro.replace("ENTRY", "WANT")), name
    entries = {name: (macro, call) for _, _, macro, name, call in found}
    assert len(entries) == len(found)  # each defined once
    return entries


def test_the_tables_name_exactly_the_entry_programs_of_bpf_allocators_h():
    """Every (call, layout) of the tables is an entry of bpf/allocators.h counted as its call
    type (free-type functions: free_p1 or free_nest, chosen per file), C++'s in the C++ list,
    and every entry there is used by a table."""
    from pymtrace.bpf import structs

    entries = _entries_of_bpf_allocators_h()
    c_tables = {f for table in allocators.FAMILIES.values() for f in table}
    used = {f"{f.call}_{f.layout}" for f in c_tables if f.call != "free"} | {"free_p1", "free_nest"}
    assert {f.layout for f in c_tables if f.call == "free"} == {"p1"}
    cxx = {f"{f.call}_{f.layout}" for f in allocators.CXX}
    assert {n for n, (macro, _) in entries.items() if macro == "AL_ENTRY"} == used
    assert {n for n, (macro, _) in entries.items() if macro == "AL_CXX_ENTRY"} == cxx
    for f in c_tables | set(allocators.CXX):
        name = f"{f.call}_{f.layout}" if f.call != "free" else "free_p1"
        assert entries[name][1] == "CALL_" + f.call.upper(), f.name
    assert allocators.CXX_PROGRAMS == {"ms_f_" + n for n in cxx} | {"ms_f_return"}
    consts = structs.header("malloc_stats").consts
    assert all(call in consts for _, call in entries.values())
