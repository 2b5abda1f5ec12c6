"""Probe sites decoded from Debian 13's glibc 2.41 (libc6 2.41-12+deb13u5, amd64), whose code
is embedded below, so the choice is checked without that libc installed.

What 2.41 changes against 2.36 (see docs/top.md, Probe placement): free's free(NULL) `ret`
moves from +0xc8 to +0x188; memalign and aligned_alloc are two functions (one address in
2.36); realloc(NULL, n) still leaves through a tail `jmp` into malloc, which the BPF
programs count once as realloc (bpf/malloc_stats.bpf.c, outer calls).
"""

import capstone

from pymtrace.tracee import probesite

# __libc_free at 0xa2fc0, its whole symbol (0x204 bytes): `test %rdi,%rdi; je +0x188`
# (free(NULL): a lone `ret`), then `push %r15` at +9.
FREE_ADDR = 0xA2FC0
FREE = bytes.fromhex(
    "4885ff0f847f010000415741564155415455488d6ff0534883ec284c8b250e1e1400488b47f864458b2c24a8020f85ed"
    "0000004c8b358e1d14006449833e000f846b0100004c8d3db42a1400a8047426488b0d99211400488d148d0000000048"
    "f7da4885c948c7c1000000fc480f44d14821ea4c8b3a4989c04983e0f84c89c248f7da4839ea0f820401000040f6c50f"
    "0f85fa0000004983f81f0f8600010000a8080f85f800000064498b164885d20f84bb0000004d8d70ef49c1ee044c3b35"
    "642114000f83a6000000488b1d8791140048395f080f84fe000000420fb73472483b35512114004889f00f8380000000"
    "4889f983c00148895f0848c1e90c4a338cf28000000048890f4a89bcf2800000006642890472eb400f1f840000000000"
    "8b15e220140085d275264839059f201400731d483d0000000277154883e0f84889058a2014004801c048890570201400"
    "4889efe898b2ffff6445892c244883c4285b5d415c415d415e415fc30f1f400031c94c89c24889ee4c89ffe8a0d1ffff"
    "ebd6660f1f440000c30f1f8000000000488d3da93f1000e834b0ffff0f1f4000488d3dc13f1000e824b0ffff0f1f4000"
    "488b15211c140064803a000f8584feffff48897c2408e805eeffff488b7c2408488b47f8e96cfeffff4c89f648895424"
    "184c8944241048897c2408e800b0ffff488b5424184c8b442410488b7c2408e9d7feffff"
)

# __libc_realloc at 0xa3310, its first 0x58 bytes: six pushes, then for realloc(NULL, n)
# the pops and `jmp a28d0 <malloc>` at +0x40 (a tail call: malloc returns to realloc's caller).
REALLOC_ADDR = 0xA3310
MALLOC_ADDR = 0xA28D0
REALLOC_HEAD = bytes.fromhex(
    "4157415641554154554889f5534889fb4883ec38803dfd8e1400000f84af0100004885ed75224885db0f85a102000048"
    "83c4384889ef5b5d415c415d415e415fe97bf5ffff0f1f004885db74e24c8b63f84c8d73f04d89e5"
)

# __libc_memalign at 0xa39c0, its whole symbol (0x34 bytes): `cmpb $0,...; je; jmp _mid_memalign`.
MEMALIGN_ADDR = 0xA39C0
MEMALIGN = bytes.fromhex(
    "803d61881400007407e912f2ffff66904883ec18488974240848893c24e8beb4ffff488b742408488b3c244883c418e9ecf1ffff"
)


def test_free_probe_moves_to_the_push_and_covers_the_null_ret():
    sites = probesite.choose(FREE, FREE_ADDR, len(FREE), "free")
    assert sites.offset == 9  # `push %r15`: emulated, every non-NULL free passes it
    assert sites.side_paths == (0x188,)  # free(NULL)'s `ret`, reached by the `je` at +3 alone
    assert FREE[9:11] == b"\x41\x57"
    assert FREE[0x188] == 0xC3


def test_free_null_ret_is_reached_by_one_branch_only():
    # what choose() proves before it puts the second probe there, spelled out on the bytes
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    insns = list(md.disasm(FREE, FREE_ADDR))
    assert sum(i.size for i in insns) == len(FREE)  # the whole symbol decodes
    target = f"{FREE_ADDR + 0x188:#x}"
    assert [i.address - FREE_ADDR for i in insns if i.op_str == target] == [3]
    before = [i for i in insns if i.address < FREE_ADDR + 0x188 and not i.mnemonic.startswith("nop")][-1]
    assert before.mnemonic == "jmp"  # no fall-through into the `ret`


def test_realloc_probe_stays_at_its_push_and_null_path_tail_calls_malloc():
    sites = probesite.choose(REALLOC_HEAD, REALLOC_ADDR, len(REALLOC_HEAD), "realloc")
    assert sites.offset == 0 and sites.side_paths == ()
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    tail = [i for i in md.disasm(REALLOC_HEAD, REALLOC_ADDR) if i.mnemonic == "jmp"]
    assert [(i.address - REALLOC_ADDR, i.op_str) for i in tail] == [(0x40, f"{MALLOC_ADDR:#x}")]


def test_memalign_probe_stays_at_zero_before_its_tail_jump():
    sites = probesite.choose(MEMALIGN, MEMALIGN_ADDR, len(MEMALIGN), "memalign")
    assert sites.offset == 0 and sites.side_paths == ()
    assert "jmp" in sites.reason
