"""Where to put a uprobe in an allocator function so that the kernel need not single-step.

The kernel emulates a `push reg` or a 1-byte `nop` at a probe site (~0.7 us a hit) but
single-steps most other instructions out of line (~5 us; 13 us measured here for glibc
2.36's `free`, which starts with `test %rdi,%rdi; je`). So we decode the function's
first instructions (capstone) and move the probe forward over instructions that neither
change the argument registers nor the stack nor memory -- `endbr64` (CET's marker, which
libstdc++'s operator new/delete start with), `test`/`cmp`, a write of a scratch register
(rax, r10, r11: neither argument nor callee-saved) and conditional branches -- to the first
emulated instruction (also an unconditional `jmp` reached without a branch, which the kernel
emulates: operator delete's tail jump to free). Every path that branched away before that point is
covered by one more probe at the branch target, placed only if the target is reached by
that branch alone (checked by decoding the whole function). If any of that cannot be
proven, the probe stays at +0: correct first, cheap second.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import struct
from typing import Any

from pymtrace.errors import PymtraceError
from pymtrace.tracee import elf

_HARMLESS = {"test", "cmp", "endbr64"}  # read registers/memory, write only flags (endbr64: nothing)
# registers a function may clobber before its first instruction that matters here: not an
# argument (rdi, rsi, rdx, rcx, r8, r9), not the stack, not callee-saved
_SCRATCH = {"rax", "eax", "ax", "al", "r10", "r10d", "r11", "r11d", "rflags"}


@dataclasses.dataclass(frozen=True)
class Sites:
    function: str
    offset: int  # main probe: offset from the function's start
    side_paths: tuple = ()  # offsets of branch targets taken before the main probe
    reason: str = ""

    @property
    def moved(self) -> bool:
        return self.offset != 0


def _decoder():
    # capstone (~60 ms to import) is imported here, not at module load: commands decode
    # functions while their BPF programs compile, off their start-up path
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def _branch_target(insn: Any) -> int | None:
    from capstone import x86_const as X

    if insn.group(X.X86_GRP_JUMP) and insn.operands and insn.operands[0].type == X.X86_OP_IMM:
        return insn.operands[0].imm
    return None


def _is_emulated(insn: Any) -> bool:
    from capstone import x86_const as X

    if insn.mnemonic == "push" and insn.operands and insn.operands[0].type == X.X86_OP_REG:
        return True
    if insn.mnemonic == "jmp" and insn.operands and insn.operands[0].type == X.X86_OP_IMM:
        return True  # a relative jmp: the kernel emulates branches (tail-jumping forwarders)
    return insn.mnemonic == "nop" and insn.size == 1


def _writes_scratch_only(insn: Any) -> bool:
    """Whether INSN only writes scratch registers, from registers or an immediate (no memory
    operand, not a branch): the arguments, the stack and memory are as at the function's entry."""
    from capstone import x86_const as X

    if insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL) or insn.group(X.X86_GRP_RET):
        return False
    if any(op.type == X.X86_OP_MEM for op in insn.operands):
        return False
    _, written = insn.regs_access()
    return bool(written) and all(insn.reg_name(r) in _SCRATCH for r in written)


def choose(code: bytes, start: int, size: int, function: str = "?") -> Sites:
    """Pick probe sites for the function whose CODE (bytes) starts at virtual address START."""
    md = _decoder()
    insns = list(md.disasm(code[:size], start))
    if not insns:
        return Sites(function, 0, (), "could not decode")
    if _is_emulated(insns[0]):
        return Sites(function, 0, (), f"+0 is `{insns[0].mnemonic} {insns[0].op_str}` (emulated)")
    side = []
    for insn in insns[:8]:
        if _is_emulated(insn):
            if insn.mnemonic == "jmp" and side:
                # a tail jump after an early-exit branch (glibc's memalign): two sites, and the
                # return probe stays at +0: no fewer traps than one at +0
                return Sites(function, 0, (), f"+0: cannot move past `{insn.mnemonic} {insn.op_str}`")
            break
        if insn.mnemonic in _HARMLESS or _writes_scratch_only(insn):
            continue
        target = _branch_target(insn)
        if target is not None and insn.mnemonic not in ("jmp", "call") and start <= target < start + size:
            side.append(target)
            continue
        return Sites(function, 0, (), f"+0: cannot move past `{insn.mnemonic} {insn.op_str}`")
    else:
        return Sites(function, 0, (), "+0: no emulated instruction near the start")
    main = insn.address
    # Each side target must be reached only by its own branch: no other jump in the
    # function lands there and the instruction before it does not fall through.
    by_address = {i.address: k for k, i in enumerate(insns)}
    for target in side:
        if target not in by_address:
            return Sites(function, 0, (), "+0: branch target is not an instruction boundary")
        users = [i for i in insns if _branch_target(i) == target]
        k = by_address[target] - 1
        while k >= 0 and insns[k].mnemonic.startswith("nop"):  # alignment padding
            k -= 1
        falls_through = k >= 0 and insns[k].mnemonic not in ("jmp", "ret")
        if len(users) != 1 or falls_through:
            return Sites(function, 0, (), "+0: branch target is shared with other paths")
    return Sites(
        function,
        main - start,
        tuple(t - start for t in side),
        f"+{main - start:#x} is `{insn.mnemonic} {insn.op_str}` (emulated)"
        + "".join(f"; +{t - start:#x} covers the early-exit branch" for t in side),
    )


# legacy prefixes x86 uprobes refuse an instruction for (the kernel's is_prefix_bad): LOCK and
# the six segment overrides (DS also marks `notrack` branches); the kernel answers ENOTSUPP
_REFUSED_PREFIXES = frozenset({0xF0, 0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65})


def refused(insn: Any) -> bool:
    """Whether the kernel will not put a uprobe on INSN (a capstone instruction): it has a
    LOCK or segment prefix."""
    return any(p in _REFUSED_PREFIXES for p in insn.prefix)


def _steps_over(insn: Any) -> bool:
    """Whether a probe after INSN sees what one on it would: INSN is no branch, call or
    return, writes only scratch registers and flags (the arguments and the stack pointer are
    as at the function's entry: a return probe there finds the return address at [rsp]), and
    addresses memory only at a fixed place (rip-relative or absolute: a counter of the
    library's own), never through a register the caller set."""
    from capstone import x86_const as X

    if insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL) or insn.group(X.X86_GRP_RET):
        return False
    if insn.group(X.X86_GRP_INT) or insn.mnemonic in ("syscall", "sysenter"):
        return False
    for op in insn.operands:
        if op.type == X.X86_OP_MEM and (op.mem.base not in (0, X.X86_REG_RIP) or op.mem.index != 0):
            return False
    _, written = insn.regs_access()
    return all(insn.reg_name(r) in _SCRATCH for r in written)


def past_refused(code: bytes, start: int, size: int) -> int | None:
    """Where to probe the function whose CODE starts at START when the kernel refuses its
    first instruction (refused()): the offset of the first instruction it accepts, when each
    one before it can be stepped over (_steps_over: same arguments, same stack) and no jump
    in the function lands after +0 up to that place (a loop would pass the probe again).
    None when +0 is accepted or that cannot be proven."""
    insns = list(_decoder().disasm(code[:size], start))
    k = 0
    while k < min(len(insns), 8) and refused(insns[k]):
        if not _steps_over(insns[k]):
            return None
        k += 1
    if k == 0 or k == len(insns) or refused(insns[k]):
        return None
    site = insns[k].address
    if any(t is not None and start < t <= site for t in map(_branch_target, insns)):
        return None
    return site - start


@functools.lru_cache(maxsize=128)
def sites(path: str, function: str) -> Sites:
    """Probe sites for FUNCTION in the ELF file PATH."""
    sym = elf.symbol(path, function)
    size = sym.size or 256
    code = elf.read_code(path, sym.address, size)
    return choose(code, sym.address, len(code), function)


def emulated_at(path: str, address: int) -> bool:
    """Whether a uprobe at ELF virtual ADDRESS of PATH is emulated by the kernel (else its
    instruction is single-stepped out of line, ~5x the cost); False when it cannot be told."""
    try:
        code = elf.read_code(path, address, 16)
        insn = next(_decoder().disasm(code, address), None)
    except Exception:  # an unreadable file, a decoder error: single-stepped, the costlier guess
        return False
    return insn is not None and _is_emulated(insn)


def entry_site(path: str, function: str) -> int:
    """ELF address of FUNCTION's (main) entry probe in PATH."""
    return elf.symbol(path, function).address + sites(path, function).offset


_SHUTDOWN_MSG = b"tcache_thread_shutdown(): unaligned tcache chunk detected\0"


@functools.lru_cache(maxsize=16)
def tcache_shutdown_returns(path: str) -> tuple[int, ...]:
    """Return addresses (ELF vaddrs) of glibc's calls to free inside tcache_thread_shutdown.

    Found without symbols: the function is the code that loads the address of its own
    error message (`lea reg, [rip+msg]`); its direct `call free` instructions lie within
    a few dozen bytes of that. Empty if this libc has no such code (then nothing is skipped).
    """
    headers = elf.program_headers(path)
    if headers is None:
        return ()
    segs = [s for s in headers.segments if s.type == elf.PT_LOAD]
    try:
        free = elf.symbol(path, "free").address
        with open(path, "rb") as f:
            blob = f.read()
    except (PymtraceError, OSError):
        return ()
    pos = blob.find(_SHUTDOWN_MSG)
    if pos < 0:
        return ()

    def vaddr(off: int) -> int | None:
        for s in segs:
            if s.offset <= off < s.offset + s.filesz:
                return s.vaddr + off - s.offset
        return None

    msg = vaddr(pos)
    found = []
    for s in segs:
        if not s.flags & elf.PF_X:
            continue
        va, text = s.vaddr, blob[s.offset : s.offset + s.filesz]
        for m in re.finditer(rb"[\x48\x4c]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", text, re.S):
            i = m.start()
            disp = struct.unpack_from("<i", text, i + 3)[0]
            if va + i + 7 + disp != msg:
                continue
            for j in range(max(0, i - 0x80), min(len(text) - 5, i + 0x40)):
                if text[j] == 0xE8 and va + j + 5 + struct.unpack_from("<i", text, j + 1)[0] == free:
                    found.append(va + j + 5)
    return tuple(sorted(set(found)))[:2] if len(set(found)) <= 2 else ()
