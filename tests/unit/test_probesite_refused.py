"""probesite.past_refused: where to probe a function whose first instruction x86 uprobes
refuse (a LOCK or segment prefix: the kernel answers ENOTSUPP), from code bytes (no root)."""

import pytest

from pymtrace.tracee import probesite

START = 0x1150
LOCK_ADD = bytes.fromhex("f0488305c72e000001")  # lock addq $1, 0x2ec7(%rip): a counter of its own
TAIL_JUMP = bytes.fromhex("ff25d12e0000")  # jmp *0x2ed1(%rip): dlsym(RTLD_NEXT)'s next malloc


def test_a_counters_lock_add_is_stepped_over_to_its_tail_jump():
    assert probesite.past_refused(LOCK_ADD + TAIL_JUMP, START, 15) == len(LOCK_ADD)


def test_a_thread_pointer_read_into_a_scratch_register_is_stepped_over():
    mov_fs = bytes.fromhex("64488b042528000000")  # mov %fs:0x28, %rax (the stack protector's canary)
    assert probesite.past_refused(mov_fs + bytes.fromhex("53c3"), START, 11) == len(mov_fs)


@pytest.mark.parametrize(
    "code, why",
    [
        (bytes.fromhex("53") + TAIL_JUMP, "push %rbx: the kernel accepts +0"),
        (bytes.fromhex("3eff25d02e0000") + TAIL_JUMP, "notrack jmp: the refused instruction is the jump"),
        (bytes.fromhex("f0480fc13dc72e0000") + TAIL_JUMP, "lock xadd %rdi: it changes the argument"),
        (bytes.fromhex("f048830701") + TAIL_JUMP, "lock addq $1, (%rdi): memory the caller points to"),
        (bytes.fromhex("f0488305c72e000001") * 9 + TAIL_JUMP, "nine refused instructions: not proven"),
        # +9: test %rdi,%rdi; +12: jne +9 (a loop would pass a probe at +9 again); +14: ret
        (LOCK_ADD + bytes.fromhex("4885ff75fbc3"), "a jump lands on the new site"),
        (LOCK_ADD, "nothing after the refused instruction"),
    ],
)
def test_no_site_unless_it_sees_the_same_call(code, why):
    assert probesite.past_refused(code, START, len(code)) is None, why


def test_refused_names_the_prefixes_the_kernel_refuses():
    md = probesite._decoder()
    first = [next(md.disasm(bytes.fromhex(h), START)) for h in ("f0488305c72e000001", "3eff25d02e0000", "53")]
    assert [probesite.refused(insn) for insn in first] == [True, True, False]
