"""The malloc APIs of allocators other than glibc, as data, and where top probes them.

glibc's functions and their programs are in pymtrace.tracee.mallocapi. Here: jemalloc,
tcmalloc, mimalloc, and any other object (a library, or the executable itself) that defines
`malloc` (the "generic" family: the C standard names only). Each function is counted as
one of top's call types; `layout` says where its size and pointer arguments are. The pair
names its BPF entry program, defined once for every program that probes these functions in
bpf/allocators.h (<call>_<layout>: top's ms_f_<call>_<layout>, record's enter_f_<call>_<layout>).

Double counting is ruled out by construction, not by knowing each allocator's internals:
names at one address are probed once (jemalloc's je_malloc/malloc, tcmalloc's
malloc/tc_malloc), every allocating function is an outer call (entry + return probe: what
it calls inside is not counted again), a function that only tail-jumps to another probed
one is not probed (its calls reach that one's probe), and a free-type function that calls
another probed function gets a return probe too (`nest`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from pymtrace.errors import PymtraceError
from pymtrace.tracee import elf, probesite


@dataclasses.dataclass(frozen=True)
class ApiFunction:
    name: str  # the symbol
    call: str  # the call type it is counted as (top's columns, the exporter's call label)
    layout: str  # where its arguments are: bpf/allocators.h says what each layout reads

    @property
    def program(self) -> str:
        """top's BPF entry program (bpf/malloc_stats.bpf.c, of bpf/allocators.h's entries)."""
        return f"ms_f_{self.call}_{self.layout}"


def _f(name: str, call: str, layout: str) -> ApiFunction:
    return ApiFunction(name, call, layout)


# the C standard and POSIX/BSD names every family defines (those it has are probed)
STANDARD: tuple[ApiFunction, ...] = (
    _f("malloc", "malloc", "s1"),
    _f("calloc", "calloc", "n1s2"),
    _f("realloc", "realloc", "p1s2"),
    _f("free", "free", "p1"),
    _f("memalign", "memalign", "s2"),
    _f("aligned_alloc", "memalign", "s2"),
    _f("posix_memalign", "posix_memalign", "p1s3"),
    _f("valloc", "valloc", "s1"),
    _f("pvalloc", "pvalloc", "s1"),
)

_JEMALLOC_EXTRA = (
    _f("mallocx", "malloc", "s1"),
    _f("rallocx", "realloc", "p1s2"),
    _f("xallocx", "realloc", "x"),
    _f("sdallocx", "free", "p1"),
    _f("dallocx", "free", "p1"),
)

FAMILIES: dict[str, tuple[ApiFunction, ...]] = {
    # plain names, the je_-prefixed ones of a build configured with --with-jemalloc-prefix
    "jemalloc": STANDARD
    + _JEMALLOC_EXTRA
    + tuple(_f("je_" + f.name, f.call, f.layout) for f in STANDARD + _JEMALLOC_EXTRA),
    "tcmalloc": STANDARD
    + (
        _f("tc_malloc", "malloc", "s1"),
        _f("tc_malloc_skip_new_handler", "malloc", "s1"),
        _f("tc_calloc", "calloc", "n1s2"),
        _f("tc_realloc", "realloc", "p1s2"),
        _f("tc_free", "free", "p1"),
        _f("tc_cfree", "free", "p1"),
        _f("tc_free_sized", "free", "p1"),
        _f("tc_memalign", "memalign", "s2"),
        _f("tc_posix_memalign", "posix_memalign", "p1s3"),
        _f("tc_valloc", "valloc", "s1"),
        _f("tc_pvalloc", "pvalloc", "s1"),
    ),
    "mimalloc": STANDARD
    + (
        _f("mi_malloc", "malloc", "s1"),
        _f("mi_malloc_small", "malloc", "s1"),
        _f("mi_mallocn", "malloc", "n1s2"),
        _f("mi_calloc", "calloc", "n1s2"),
        _f("mi_zalloc", "calloc", "s1"),
        _f("mi_zalloc_small", "calloc", "s1"),
        _f("mi_realloc", "realloc", "p1s2"),
        _f("mi_reallocf", "realloc", "p1s2"),
        _f("reallocf", "realloc", "p1s2"),
        _f("mi_realloc_aligned", "realloc", "p1s2"),
        _f("mi_free", "free", "p1"),
        _f("mi_free_size", "free", "p1"),
        _f("mi_free_aligned", "free", "p1"),
        _f("mi_free_size_aligned", "free", "p1"),
        _f("mi_malloc_aligned", "memalign", "s1"),
        _f("mi_zalloc_aligned", "memalign", "s1"),
        _f("mi_memalign", "memalign", "s2"),
        _f("mi_aligned_alloc", "memalign", "s2"),
        _f("mi_posix_memalign", "posix_memalign", "p1s3"),
        _f("mi_valloc", "valloc", "s1"),
        _f("mi_pvalloc", "pvalloc", "s1"),
    ),
    # any other object defining malloc: a library of its own, or the executable
    "generic": STANDARD,
}


# C++ operator new/delete (Itanium ABI names, size_t = unsigned long), each variant its own
# call type (bpf/malloc_stats.h CALL_NEW..). Where two names share an address (tcmalloc's and
# mimalloc's new and new[] are one function) the first here wins: such an allocator's new[]
# is counted as new. Defined by libstdc++ and by every allocator that replaces them
# (jemalloc, tcmalloc, mimalloc); where a process's calls go: libc.cxx_runtime.
_NT = "RKSt9nothrow_t"
_AL = "St11align_val_t"
CXX: tuple[ApiFunction, ...] = (
    _f("_Znwm", "new", "s1"),
    _f("_Znam", "new_array", "s1"),
    _f("_Znwm" + _NT, "new_nothrow", "s1"),
    _f("_Znam" + _NT, "new_nothrow", "s1"),
    _f("_Znwm" + _AL, "new_aligned", "s1"),
    _f("_Znam" + _AL, "new_aligned", "s1"),
    _f("_Znwm" + _AL + _NT, "new_aligned", "s1"),
    _f("_Znam" + _AL + _NT, "new_aligned", "s1"),
    _f("_ZdlPv", "delete", "p1"),
    _f("_ZdaPv", "delete_array", "p1"),
    _f("_ZdlPv" + _NT, "delete", "p1"),
    _f("_ZdaPv" + _NT, "delete_array", "p1"),
    _f("_ZdlPvm", "delete_sized", "p1"),
    _f("_ZdaPvm", "delete_sized", "p1"),
    _f("_ZdlPv" + _AL, "delete_aligned", "p1"),
    _f("_ZdaPv" + _AL, "delete_aligned", "p1"),
    _f("_ZdlPvm" + _AL, "delete_aligned", "p1"),
    _f("_ZdaPvm" + _AL, "delete_aligned", "p1"),
    _f("_ZdlPv" + _AL + _NT, "delete_aligned", "p1"),
    _f("_ZdaPv" + _AL + _NT, "delete_aligned", "p1"),
)
CXX_FAMILY = "c++"  # probe_plan's key for CXX
# every program CXX's functions can use (every variant has a return probe)
CXX_PROGRAMS = frozenset({f.program for f in CXX} | {"ms_f_return"})


def family_of(name: str) -> str:
    """The FAMILIES key for an allocator named NAME by pymtrace.tracee.libc.allocator."""
    return name if name in FAMILIES else "generic"


@dataclasses.dataclass(frozen=True)
class Probe:
    function: str  # the symbol attached to
    kind: str  # "entry" or "return"
    offset: int  # entry: from the function's start
    program: str  # BPF function


def direct_targets(code: bytes, start: int) -> list[tuple[str, int]]:
    """(mnemonic, target) of every direct call/jump in CODE (decoded at address START)."""
    import capstone
    from capstone import x86_const as X

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    out = []
    for insn in md.disasm(code, start):
        if (insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL)) and insn.operands:
            if insn.operands[0].type == X.X86_OP_IMM:
                out.append((insn.mnemonic, insn.operands[0].imm))
    return out


def _leaves(code: bytes, start: int) -> bool:
    """Whether the function whose CODE starts at START calls or jumps out of itself: through
    a register or memory (a function pointer: an interposer's dlsym(RTLD_NEXT) forward), or
    to an address outside CODE (another function, a PLT stub)."""
    import capstone
    from capstone import x86_const as X

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    for insn in md.disasm(code, start):
        if (insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL)) and insn.operands:
            op = insn.operands[0]
            if op.type != X.X86_OP_IMM or not start <= op.imm < start + len(code):
                return True
    return False


def plt_stubs(path: str, got: bool = False) -> dict[int, str]:
    """{address of a PLT stub: the symbol it jumps to} of PATH: each stub's `jmp
    *slot(%rip)` decoded, its GOT slot named by the JUMP_SLOT relocations (.rela.plt).
    Calls between an allocator's own exported functions go through these (mimalloc's
    posix_memalign is `jmp mi_posix_memalign@plt`). GOT: the .plt.got stubs too (functions
    whose address the file also takes: libstdc++'s `jmp _ZdaPv@plt`), named by .rela.dyn."""
    import capstone
    from capstone import x86_const as X
    from elftools.elf.elffile import ELFFile
    from elftools.elf.relocation import RelocationSection

    stubs = {}
    with open(path, "rb") as f:
        e = ELFFile(f)
        slots = {}
        for section in e.iter_sections():
            if isinstance(section, RelocationSection) and section.name in (
                (".rela.plt", ".rel.plt", ".rela.dyn") if got else (".rela.plt", ".rel.plt")
            ):
                symtab = e.get_section(section["sh_link"])
                for rel in section.iter_relocations():
                    if rel["r_info_sym"]:
                        slots[rel["r_offset"]] = symtab.get_symbol(rel["r_info_sym"]).name
        if not slots:
            return stubs
        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        md.detail = True
        for name in (".plt", ".plt.sec", ".plt.got") if got else (".plt", ".plt.sec"):
            section = e.get_section_by_name(name)
            if section is None:
                continue
            for insn in md.disasm(section.data(), section["sh_addr"]):
                if insn.mnemonic != "jmp" or not insn.operands:
                    continue
                op = insn.operands[0]
                if op.type == X.X86_OP_MEM and op.mem.base == X.X86_REG_RIP:
                    slot = insn.address + insn.size + op.mem.disp
                    if slot in slots:
                        stubs[insn.address] = slots[slot]
                        stubs[insn.address & ~15] = slots[slot]  # the entry's start (endbr64 first)
    return stubs


def _branch_site(code: bytes, start: int) -> int | None:
    """Offset of a conditional jump that every call reaches with its argument registers and
    stack untouched (only `test`/`cmp` before it), or None. The kernel emulates jcc (as it
    does `push`: pymtrace.tracee.probesite), so a probe there costs no single-step where +0
    (jemalloc's malloc: `cmp $0x1000,%rdi; ja ...`) would. Refused when any jump in the
    function lands on it or before it (a loop would hit the probe again)."""
    import capstone
    from capstone import x86_const as X

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    site = None
    for insn in md.disasm(code[:64], start):
        if insn.mnemonic in ("test", "cmp"):
            continue
        if insn.group(X.X86_GRP_JUMP) and insn.mnemonic != "jmp" and insn.operands:
            if insn.operands[0].type == X.X86_OP_IMM:
                site = insn.address
        break
    if site is None or site == start:
        return None
    if any(start < t <= site for _, t in direct_targets(code, start)):
        return None
    return site - start


@dataclasses.dataclass(frozen=True)
class _Chosen:
    function: ApiFunction
    address: int
    size: int
    program: str  # its entry program
    nested: bool  # with a return probe (ms_f_return)


@functools.lru_cache(maxsize=64)
def _choose(path: str, family: str, _key: Any) -> tuple[_Chosen, ...]:
    """The functions of FAMILY probed in PATH and their programs, without placing a probe:
    the part of the plan the compile depends on (programs()), cheap enough to run before it
    (symbols, PLT stubs, each function's first instruction, and only the free-type
    functions decoded whole: ~0.01-0.03 s a file, against 0.05-0.3 s for the probe sites)."""
    syms = elf.symbols(path)
    cxx = family == CXX_FAMILY
    chosen = {}  # address -> ApiFunction (first name in the table wins)
    for f in CXX if cxx else FAMILIES[family]:
        sym = syms.get(f.name)
        if sym is not None and sym.address not in chosen:
            chosen[sym.address] = (f, sym)
    if cxx:
        # a C allocator's function at the same address (tcmalloc's and mimalloc's operator
        # delete is their free): one function, probed once, under its C name (the family's plan)
        c_names = {f.name for table in FAMILIES.values() for f in table}
        taken = {sym.address for name, sym in syms.items() if name in c_names}
        chosen = {a: v for a, v in chosen.items() if a not in taken}
    if not any(f.name.endswith("malloc") or f.name == "_Znwm" for f, _ in chosen.values()):
        raise PymtraceError(f"{path} defines no {'operator new' if cxx else 'malloc'}")
    plt = plt_stubs(path) if not cxx else {}  # C++'s variants: neither forwarders nor free-type

    def probed(target: int) -> int | None:
        """The probed function a call/jump to TARGET reaches (directly or via a PLT stub)."""
        if target in chosen:
            return target
        sym = syms.get(plt.get(target, ""))
        return sym.address if sym is not None and sym.address in chosen else None

    out = []
    for address, (f, sym) in sorted(chosen.items(), key=lambda item: item[1][0].name):
        if not cxx:
            code = elf.read_code(path, address, min(sym.size or 10, 10))
            head = code[4:] if code.startswith(b"\xf3\x0f\x1e\xfa") else code  # endbr64
            first = direct_targets(head[:6], address + len(code) - len(head))
            if first and first[0][0] == "jmp" and probed(first[0][1]) not in (None, address):
                continue  # a forwarder: every call reaches the probed function it jumps to (C++'s
                # variants are kept: each is its own call type, nesting depth counts it once)
        nested = f.call != "free"
        if not nested:  # a free-type function calling another probed one is nested too
            code = elf.read_code(path, address, sym.size or 256)
            nested = any(probed(t) not in (None, address) for _, t in direct_targets(code, address))
            # another object's free that leaves itself may forward to the next definition (an
            # LD_PRELOAD interposer: glibc's free, probed beside it by `record -- CMD`)
            nested = nested or (family == "generic" and _leaves(code, address))
        program = f.program if f.call != "free" else ("ms_f_free_nest" if nested else "ms_f_free_p1")
        out.append(_Chosen(f, address, sym.size, program, nested))
    return tuple(out)


def cache_key(path: str) -> tuple[int, int, int]:
    """(device, inode, mtime) of PATH, a plan cache's key; PymtraceError when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PymtraceError(f"{path}: {exc.strerror or exc}") from None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def programs(path: str, family: str) -> frozenset[str]:
    """The BPF programs (top's ms_f_*) probe_plan(PATH, FAMILY) attaches,
    known before the probe sites are decoded: a command compiles exactly these. Raises as
    probe_plan does."""
    chosen = _choose(path, family, cache_key(path))
    return frozenset({c.program for c in chosen} | ({"ms_f_return"} if any(c.nested for c in chosen) else set()))


@functools.lru_cache(maxsize=64)
def _plan(path: str, family: str, _key: Any, past_refused: bool) -> tuple[tuple[str, tuple[Probe, ...]], ...]:
    plan = []
    for c in _choose(path, family, _key):
        f, address = c.function, c.address
        code = elf.read_code(path, address, c.size or 256)
        sites = probesite.choose(code, address, len(code), f.name)
        offsets = (sites.offset,) + tuple(sites.side_paths)
        if offsets == (0,) and "(emulated)" not in sites.reason:
            branch = _branch_site(code, address)  # +0 would be single-stepped
            if branch is not None:
                offsets = (branch,)
        if offsets == (0,) and past_refused:
            past = probesite.past_refused(code, address, len(code))  # +0: the kernel refuses it
            if past is not None:
                offsets = (past,)
        probes = [Probe(f.name, "entry", off, c.program) for off in offsets]
        if c.nested:
            # a uretprobe is a breakpoint too: on the entry's site when that is the only one
            # (one trap, emulated); attached by address, so only where the file offset is the
            # address (every shared object here), leaving no doubt how BCC reads it
            ret = offsets[0] if len(offsets) == 1 else 0
            if ret and elf.file_offset(path, address + ret)[0] != address + ret:
                ret = 0
            probes.append(Probe(f.name, "return", ret, "ms_f_return"))
        plan.append((f.name, tuple(probes)))
    return tuple(plan)


def probe_plan(path: str, family: str, past_refused: bool = False) -> list[tuple[str, tuple[Probe, ...]]]:
    """top's uprobes for the allocator FAMILY (a FAMILIES key, or CXX_FAMILY: operator
    new/delete, every variant with a return probe) in the ELF file PATH:
    [(function, (Probe, ...))], each function found in PATH once per address. PAST_REFUSED
    (record): a function whose first instruction the kernel refuses a uprobe on (an
    LD_PRELOAD counter's `lock add`) is probed at the next one it accepts, where that sees
    the same call (probesite.past_refused). Raises PymtraceError when PATH cannot be read or
    defines no malloc."""
    return list(_plan(path, family, cache_key(path), past_refused))
