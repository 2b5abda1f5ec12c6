"""Where `record` probes C++ operator new/delete: the fewest uprobe traps that keep its records.

`record` writes every new as malloc (an aligned one as memalign) and every delete as free,
with the program's return address as the caller (docs/formats.md). top's plan
(pymtrace.tracee.allocators.probe_plan: every variant its own call type, an entry and a
return probe each) makes a libstdc++ new cost four traps (its entry and return, malloc's
entry and return) and a sized delete four (_ZdlPvm -> _ZdlPv -> free, and the return). Here
each function found there gets one of three treatments, decided from its code:

  via    it only tail-jumps (`jmp`, directly or through a PLT stub) to another probed function
         recorded the same way: a C free for a delete, another variant for either, with the
         arguments and the stack untouched on the way, so the probe where it lands sees the
         program's return address and arguments. No probe (libstdc++: every delete, new[]).
  carry  a new whose first call, reached on every path without a branch, is its only call of
         a probed allocating function (malloc, aligned_alloc, ...; or of another carried
         new): an entry probe alone (bpf/record.bpf.c enter_cxx_new_<slot>), and the record
         is written at that call's own return probe, as the new (libstdc++: new -> malloc).
  own    anything else: top's entry and return probes (jemalloc's and tcmalloc's inlined
         fast paths, libstdc++'s aligned new, which checks the alignment first).

A tail jump or call through a PLT stub lands wherever the process resolves that name: each
plan lists those names (`needs`), and the recorder checks them against the process before
using it (libc.first_definer): a C name must resolve to a file whose functions it records,
an operator's to this file itself. Otherwise top's plan is used as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pymtrace.tracee import allocators, elf, libc, probesite

# what a variant is recorded as: every new as malloc, an aligned one as memalign, a delete as free
RECORDED = {
    "new": "malloc",
    "new_array": "malloc",
    "new_nothrow": "malloc",
    "new_aligned": "memalign",
    "delete": "free",
    "delete_array": "free",
    "delete_sized": "free",
    "delete_aligned": "free",
}
# C functions a new may be carried by: they return the block (posix_memalign returns an error
# code); those a delete may tail-jump to: every free-type function (the pointer first)
_C_TABLES = allocators.FAMILIES.values()
CARRIERS = frozenset(f.name for table in _C_TABLES for f in table if f.call in ("malloc", "memalign"))
FREES = frozenset(f.name for table in _C_TABLES for f in table if f.call == "free")
_CXX_CALL = {f.name: f.call for f in allocators.CXX}

# registers a tail-jumping variant must leave as they were: the pointer or size, the alignment
# (rsi) of a new, the stack pointer, and the callee-saved ones (the probe where it lands reads
# rdi/rsi and [rsp])
_KEEP_NEW = frozenset({"rdi", "edi", "rsi", "esi", "rsp", "rbx", "rbp", "r12", "r13", "r14", "r15"})
_KEEP_DELETE = _KEEP_NEW - {"rsi", "esi"}


@dataclasses.dataclass(frozen=True)
class Carried:
    """A carried new's entry probe: bpf/record.bpf.c's struct cxx_fn."""

    function: str
    offset: int  # the probe's offset from the function's start
    depth: int  # what the function has pushed on the stack there (its return address is above)
    size: int  # the function's size: its allocation call returns inside it
    recorded: str  # "malloc" or "memalign"


@dataclasses.dataclass(frozen=True)
class CxxPlan:
    probes: tuple[tuple[str, tuple[allocators.Probe, ...]], ...]  # top's plan for the "own" ones
    carried: tuple[Carried, ...]
    via: tuple[tuple[str, str], ...]  # (function, the one it jumps to)
    needs: tuple[tuple[str, bool], ...]  # (name, an operator's): how the process must resolve it

    def programs(self) -> frozenset[str]:
        """Its BPF programs, record's names: enter_f_* (allocators.h), leave, enter_cxx_new_<k>
        for k below len(carried) (the slots as the recorder gives them, from 0)."""
        names = {"enter_f_" + p.program.removeprefix("ms_f_") for _, probes in self.probes for p in probes}
        names -= {"enter_f_return", "enter_f_cxx_new"}
        names |= {f"enter_cxx_new_{k}" for k in range(len(self.carried))}
        return frozenset(names)


def _regs_written(insn: Any) -> set[str]:
    return {insn.reg_name(r) for r in insn.regs_access()[1]}


def _shape(code: bytes, start: int, keep: frozenset[str]) -> tuple[str, int, int] | None:
    """How the function whose CODE starts at START begins: ("jmp", target, 0) when it
    tail-jumps after instructions that write neither memory nor a register of KEEP; ("call",
    target, offset of the call) when its first control transfer is a direct call (what comes
    before it: anything but a branch); None otherwise."""
    import capstone
    from capstone import x86_const as X

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    quiet = True  # no memory written, no register of KEEP: a tail jump is a plain forward
    for insn in md.disasm(code, start):
        op = insn.operands[0] if insn.operands else None
        direct = op is not None and op.type == X.X86_OP_IMM
        if insn.mnemonic == "jmp":
            return ("jmp", op.imm, 0) if direct and quiet else None
        if insn.group(X.X86_GRP_CALL):
            return ("call", op.imm, insn.address - start) if direct else None
        if insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_RET) or insn.group(X.X86_GRP_INT):
            return None
        if insn.mnemonic in ("syscall", "sysenter"):
            return None
        if insn.mnemonic != "endbr64":
            writes_memory = any(o.type == X.X86_OP_MEM for o in insn.operands[:1]) or insn.mnemonic.startswith("push")
            quiet = quiet and not writes_memory and not (_regs_written(insn) & keep)
    return None


@functools.lru_cache(maxsize=32)
def _analyse(path: str, _key: Any) -> tuple[tuple, dict, dict, dict]:
    """(top's plan for PATH, {function: (treatment, target name, via PLT, call offset)} of the
    via/carry candidates, {function: Symbol}, {address: name} of the PLT stubs and probed
    variants) -- the part of the plan that does not depend on what the targets turn out to be."""
    base = allocators.probe_plan(path, allocators.CXX_FAMILY, past_refused=True)
    syms = elf.symbols(path)
    names = {**allocators.plt_stubs(path, got=True), **{syms[f].address: f for f, _ in base}}
    candidates = {}
    for function, _probes in base:
        sym = syms[function]
        deleting = RECORDED[_CXX_CALL[function]] == "free"
        shape = _shape(
            elf.read_code(path, sym.address, sym.size or 64), sym.address, _KEEP_DELETE if deleting else _KEEP_NEW
        )
        if shape is None:
            continue
        how, target, at = shape
        if target not in names:
            continue  # a function of the file's own that is not probed: its code is not followed
        through_plt = names[target] not in dict(base) or syms[names[target]].address != target
        candidates[function] = ("via" if how == "jmp" else "carry", names[target], through_plt, at)
    return tuple(base), candidates, {f: syms[f] for f, _ in base}, names


def _stack_depth(code: bytes, start: int, at: int) -> int | None:
    """Bytes the function whose CODE starts at START has pushed or reserved on the stack when
    it reaches offset AT along its straight start (push, sub $imm,%rsp); None when another
    instruction moves the stack pointer or one writes an argument (size, alignment) the probe
    there reads."""
    import capstone
    from capstone import x86_const as X

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    depth = 0
    for insn in md.disasm(code[:at], start):
        if insn.mnemonic == "push" and insn.size <= 2:
            depth += 8
        elif insn.mnemonic == "sub" and insn.op_str.startswith("rsp, ") and insn.operands[1].type == X.X86_OP_IMM:
            depth += insn.operands[1].imm
        elif _regs_written(insn) & {"rsp", "rdi", "edi", "rsi", "esi"}:
            return None
    return depth


def _carry_site(path: str, sym: elf.Symbol, at: int, probes: tuple, names: dict[int, str]) -> tuple[int, int] | None:
    """(the entry probe's offset, the bytes the function has put on the stack there) when the
    function SYM can be carried by its call at offset AT, else None. The probe: top's site when
    the kernel emulates it, else the call itself (emulated too: libstdc++'s nothrow new starts
    with `endbr64; sub $8,%rsp`, single-stepped at +0). Refused when a jump in the function
    lands between its start and the probe (it would run again, the stack moved) or the function
    calls or jumps to another probed allocating function (that call would be carried too).
    NAMES: the direct targets' names (PLT stubs, the file's probed variants)."""
    code = elf.read_code(path, sym.address, sym.size or 64)
    chosen = probesite.choose(code, sym.address, len(code), sym.name)
    entries = [p for p in probes if p.kind == "entry"]
    if "(emulated)" in chosen.reason and not chosen.side_paths and chosen.offset <= at:
        site, depth = chosen.offset, 0
    elif _stack_depth(code, sym.address, at) is not None:
        site, depth = at, _stack_depth(code, sym.address, at)
    elif len(entries) == 1 and entries[0].offset <= at:
        site, depth = entries[0].offset, 0
    else:
        return None
    allocating = 0
    for _, target in allocators.direct_targets(code, sym.address):
        if sym.address < target <= sym.address + site:
            return None
        name = names.get(target, "")
        allocating += name in CARRIERS or name in _CXX_CALL
    return (site, depth) if allocating == 1 else None


@functools.lru_cache(maxsize=64)
def _plan(path: str, carry: bool, _key_: Any) -> CxxPlan:
    base, candidates, syms, names = _analyse(path, _key_)
    probes = dict(base)
    how = {}  # function -> (treatment, target, via PLT); entries dropped until stable
    for function, (treatment, name, through_plt, at) in candidates.items():
        recorded = RECORDED[_CXX_CALL[function]]
        if name in _CXX_CALL:  # another variant: recorded the same way, and probed in this file
            if RECORDED[_CXX_CALL[name]] != recorded or name not in probes:
                continue
        elif treatment == "via" and (recorded != "free" or name not in FREES or not through_plt):
            continue  # a delete may land on a C free (through its PLT stub: resolved as the process does)
        elif treatment == "carry" and (recorded == "free" or name not in CARRIERS or not through_plt):
            continue
        if treatment == "carry":
            site = _carry_site(path, syms[function], at, probes[function], names)
            if site is None or not carry:
                continue
            how[function] = ("carry", name, through_plt, site)
        else:
            how[function] = ("via", name, through_plt, 0)

    def final(name: str) -> str:
        """How the end of the tail jumps from NAME is probed: "carry", "own", "c" (a C free,
        by the allocator's plan) or "cycle" (never probed)."""
        seen = set()
        while name in how and how[name][0] == "via":
            if name in seen:
                return "cycle"
            seen.add(name)
            name = how[name][1]
            if name not in _CXX_CALL:
                return "c"
        return how[name][0] if name in how else "own"

    changed = True
    while changed:  # a carried new calling another variant needs that one carried; a jump, an end
        changed = False
        for function, (treatment, name, _, _) in list(how.items()):
            if (treatment == "carry" and name in _CXX_CALL and final(name) != "carry") or final(function) == "cycle":
                del how[function]
                changed = True
    carried = tuple(
        Carried(f, *how[f][3], syms[f].size, RECORDED[_CXX_CALL[f]]) for f in sorted(how) if how[f][0] == "carry"
    )
    own = tuple((f, p) for f, p in base if f not in how)
    carried_probes = tuple((c.function, (allocators.Probe(c.function, "entry", c.offset, "cxx_new"),)) for c in carried)
    needs = sorted({(name, name in _CXX_CALL) for f, (_, name, through_plt, _) in how.items() if through_plt})
    return CxxPlan(
        own + carried_probes,
        carried,
        tuple((f, how[f][1]) for f in sorted(how) if how[f][0] == "via"),
        tuple(needs),
    )


def plan(path: str, carry: bool = True) -> CxxPlan:
    """record's plan for the operator new/delete of the C++ runtime PATH (libstdc++, or an
    allocator that defines them): top's probes where a function needs its own, none where it
    tail-jumps to another probed function, and an entry probe alone on a new carried by its
    allocation call, unless CARRY is False (record --stacks: a stack is taken at the recorded
    call's return, which must be the program's). Raises PymtraceError as probe_plan does."""
    return _plan(path, carry, allocators.cache_key(path))


def for_process(pid: int, path: str, recorded: dict[Any, frozenset[str]], carry: bool = True) -> CxxPlan:
    """plan(PATH, CARRY) when process PID resolves each name it `needs` as it assumes: an
    operator to PATH itself, a C function to a file RECORDED ({file key: the names record
    probes there}) that probes it; else top's plan as it is (every function its own probes)."""
    chosen = plan(path, carry)
    if chosen.needs:
        where = libc.first_definers(pid, [name for name, _ in chosen.needs])
        own = libc.file_key(path)
        for name, operator in chosen.needs:
            key = libc.file_key(where[name]) if where[name] else None
            if (key != own) if operator else (name not in recorded.get(key, ())):
                base = allocators.probe_plan(path, allocators.CXX_FAMILY, past_refused=True)
                return CxxPlan(tuple(base), (), (), ())
    return chosen
