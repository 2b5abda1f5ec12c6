"""Unit tests of the shared foundations: header parsing, probe-site choice, maps, CLI."""

import ctypes
import os
import subprocess
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cli import PYMTRACE
from support.paths import ROOT

from pymtrace.bpf import structs
from pymtrace.errors import PymtraceError
from pymtrace.tracee import libc, probesite
from pymtrace.tracee.launch import predict_libc

# --- structs: ctypes built from the C headers -------------------------------------------


def test_header_parse_layout_matches_c():
    consts, types = structs.parse(
        '#define N 3\n#define BIG 0x10\nstruct a { __u64 x; __u32 y[N]; char c[BIG]; };'
        "/* comment */ struct b { struct a inner; __s32 z; };"
    )
    assert consts == {"N": 3, "BIG": 16}
    assert ctypes.sizeof(types["a"]) == 8 + 12 + 16 + 4  # C pads a to 8-byte alignment
    assert ctypes.sizeof(types["b"]) == 48
    assert [f for f, _ in types["b"]._fields_] == ["inner", "z"]


def test_header_unknown_field_type_is_an_error():
    with pytest.raises(KeyError):
        structs.parse("struct a { float x; };")


def test_every_bpf_header_parses_and_compiles_identically(tmp_path):
    """Each bpf/*.h gives the same struct sizes in Python as gcc computes in C. Headers of BPF
    code (stackcopy.h, pywalk.h: inline functions for the programs) are not user space's: their
    structs are those of the headers they include, checked there."""
    headers = sorted(p for p in (ROOT / "bpf").glob("*.h") if p.name != "common.h")
    headers = [p for p in headers if "static __always_inline" not in p.read_text()]
    if not headers:
        pytest.skip("no program headers yet")
    for h in headers:
        parsed = structs.header(h.stem)
        if not parsed.structs:
            continue
        prog = ['#include <linux/types.h>', f'#include "{h.name}"', "#include <stdio.h>", "int main(void){"]
        prog += [f'printf("%zu\\n", sizeof(struct {n}));' for n in parsed.structs]
        prog += ["return 0;}"]
        src = tmp_path / f"{h.stem}.c"
        src.write_text("\n".join(prog))
        exe = tmp_path / h.stem
        subprocess.run(["gcc", "-I", str(ROOT / "bpf"), "-o", str(exe), str(src)], check=True)
        sizes = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()]
        assert sizes == [ctypes.sizeof(t) for t in parsed.structs.values()], h.name


def test_bpf_sources_call_user_reads_by_the_cheap_name():
    """No BPF source (nor generated USDT reader) calls bpf_probe_read_user(_str) by that name:
    BCC 0.26 rebuilds a hash of all of /proc/kallsyms at each such call site (0.05-0.1 CPU-s
    of start-up each); pymtrace.bpf.load.MODULE_PRELUDE defines the same helpers as
    pm_probe_read_user(_str)."""
    import re

    from pymtrace.bpf import load
    from pymtrace.sources import usdt

    call = re.compile(r"(?<![\w])bpf_probe_read_user(_str)?\s*\(")
    for src in sorted((ROOT / "bpf").glob("*.bpf.c")):
        assert not call.search(src.read_text()), src.name
    assert "BPF_FUNC_probe_read_user" in load.MODULE_PRELUDE
    code = usdt.arg_code(usdt.parse_arg("8@16(%rdi)"), 0, 0, {})
    assert "pm_probe_read_user(" in code and not call.search(code)


# --- probesite: where a uprobe can sit without single-stepping --------------------------

PUSH_RBP = b"\x55"
TEST_RDI = b"\x48\x85\xff"
RET = b"\xc3"
MOV_RBX_RDI = b"\x48\x89\xfb"


def je_rel32(from_next, target):
    return b"\x0f\x84" + (target - from_next).to_bytes(4, "little", signed=True)


def test_push_at_entry_stays_at_zero():
    s = probesite.choose(PUSH_RBP + MOV_RBX_RDI + RET, 0x1000, 5)
    assert s.offset == 0 and s.side_paths == ()


def test_glibc_free_shape_moves_past_test_je_and_covers_null_path():
    # test rdi,rdi ; je NULLRET ; push rbp ; ... ; pop rbp ; ret ; NULLRET: ret
    body = TEST_RDI
    null_ret = 3 + 6 + 1 + 3 + 1 + 1
    body += je_rel32(9, null_ret) + PUSH_RBP + MOV_RBX_RDI + b"\x5d" + RET + RET
    s = probesite.choose(body, 0, len(body))
    assert s.offset == 9
    assert s.side_paths == (null_ret,)


def test_shared_branch_target_falls_back_to_zero():
    # The early-exit target is also reached by a second branch: not provable, stay at +0.
    null_ret = 3 + 6 + 1 + 6 + 1
    body = TEST_RDI + je_rel32(9, null_ret) + PUSH_RBP + je_rel32(16, null_ret) + RET + RET
    s = probesite.choose(body, 0, len(body))
    assert s.offset == 0


def test_unknown_first_instruction_stays_at_zero():
    s = probesite.choose(MOV_RBX_RDI + PUSH_RBP + RET, 0, 5)
    assert s.offset == 0


ENDBR64 = b"\xf3\x0f\x1e\xfa"
MOV_1_EAX = b"\xb8\x01\x00\x00\x00"
MOV_1_EDI = b"\xbf\x01\x00\x00\x00"
SUB_8_RSP = b"\x48\x83\xec\x08"


def jmp_rel32(from_next, target):
    return b"\xe9" + (target - from_next).to_bytes(4, "little", signed=True)


def test_operator_new_shape_moves_past_endbr64_and_a_scratch_register_write():
    # libstdc++'s operator new(size_t): endbr64; test rdi,rdi; mov $1,%eax; push rbx; ...
    body = ENDBR64 + TEST_RDI + MOV_1_EAX + PUSH_RBP + MOV_RBX_RDI + RET
    s = probesite.choose(body, 0, len(body))
    assert s.offset == 12 and s.side_paths == ()


def test_operator_delete_shape_moves_to_its_tail_jump():
    # operator delete(void*): endbr64; jmp free@plt (the kernel emulates a relative jmp)
    body = ENDBR64 + jmp_rel32(9, 0x1000)
    s = probesite.choose(body, 0, len(body))
    assert s.offset == 4 and "jmp" in s.reason


def test_an_argument_or_stack_write_keeps_the_probe_at_zero():
    for first in (MOV_1_EDI, SUB_8_RSP, MOV_RBX_RDI):  # edi: an argument; rsp; rbx: callee-saved
        body = ENDBR64 + first + PUSH_RBP + RET
        assert probesite.choose(body, 0, len(body)).offset == 0, first.hex()


def test_a_tail_jump_after_an_early_exit_branch_keeps_the_probe_at_zero():
    # glibc's memalign: cmp; je SLOW; jmp FAST: two sites where +0 is one, with the return there
    slow = 3 + 6 + 5
    body = TEST_RDI + je_rel32(9, slow) + jmp_rel32(14, 0x1000) + SUB_8_RSP + RET
    s = probesite.choose(body, 0, len(body))
    assert s.offset == 0 and "jmp" in s.reason


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_choose_never_crashes_and_stays_in_bounds(code):
    s = probesite.choose(code, 0x400000, len(code))
    assert 0 <= s.offset <= max(len(code), 0)
    assert all(0 <= p < len(code) for p in s.side_paths)


def test_real_libc_free_probe_site_is_an_emulated_instruction():
    path = libc.system_libc()
    s = probesite.sites(path, "free")
    sym = libc.symbol(path, "free")
    code = libc.read_code(path, sym.address + s.offset, 2)
    assert code[0] == 0x55 or code[0] in range(0x50, 0x58) or code[:1] == b"\x41" or s.offset == 0


# --- libc / maps --------------------------------------------------------------------------

MAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
7f1c2a000000-7f1c2a028000 r--p 00000000 fe:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2a028000-7f1c2a19d000 r-xp 00028000 fe:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2b000000-7f1c2b100000 rw-p 00000000 00:00 0
7ffd1000000-7ffd1021000 rw-p 00000000 00:00 0                            [stack]
"""


def test_parse_maps():
    maps = libc.parse_maps_text(MAPS)
    assert maps[0].path == "[heap]" and maps[0].start == 0x55D0C0000000
    assert maps[2].perms == "r-xp" and maps[2].offset == 0x28000 and maps[2].inode == 1234
    assert maps[3].path == ""


def test_unreadable_maps_is_a_one_line_error(monkeypatch):
    """A process whose maps cannot be read (another user namespace, a sandbox): PymtraceError
    naming the file, never a PermissionError traceback."""

    def denied(path, *a, **kw):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(libc, "open", denied, raising=False)
    with pytest.raises(PymtraceError, match=r"^cannot read /proc/1/maps: Permission denied \(") as exc:
        libc.process_libc(1)
    assert "\n" not in str(exc.value) and not isinstance(exc.value, libc.ProcessGone)


@pytest.mark.parametrize(
    "path,yes",
    [
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", True),
        ("/lib/libc-2.17.so", True),
        ("/usr/lib/libcrypto.so.3", False),
        ("/usr/lib/libcap.so.2", False),
        ("/work/shared/glibc-sdt/libc.so.6", True),
    ],
)
def test_is_libc_path(path, yes):
    assert libc.is_libc_path(path) is yes


def test_own_process_libc_and_probe_count():
    path = libc.process_libc(os.getpid())
    assert path and os.path.exists(path)
    assert isinstance(libc.malloc_probes(path), list)


def test_sdt_libc_notes_when_present():
    sdt = ROOT.parent / "shared" / "glibc-sdt" / "libc.so.6"
    if not sdt.exists():
        pytest.skip("no ../shared/glibc-sdt")
    probes = libc.malloc_probes(str(sdt))
    assert len({p.name for p in probes}) == 29
    sbrk = [p for p in probes if p.name == "memory_sbrk_more"][0]
    assert len(sbrk.arg_specs) == 2


def test_predict_libc_plain_and_through_loader():
    assert predict_libc(["/bin/true"]) == os.path.realpath(libc.system_libc())
    sdt = ROOT.parent / "shared" / "glibc-sdt"
    if sdt.exists():
        argv = [str(sdt / "ld-linux-x86-64.so.2"), "--library-path", str(sdt), "/bin/true"]
        assert predict_libc(argv) == os.path.realpath(sdt / "libc.so.6")


# --- CLI ----------------------------------------------------------------------------------


def test_cli_help_lists_every_command():
    out = subprocess.run(PYMTRACE + ["--help"], capture_output=True, text=True)
    assert out.returncode == 0
    from pymtrace.cli import COMMANDS

    for name in COMMANDS:
        assert name in out.stdout


def test_cli_unknown_command():
    out = subprocess.run(PYMTRACE + ["frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_record_refuses_a_second_pid():
    """`record -p A -p B` records one process: refused, not B alone silently."""
    out = subprocess.run(PYMTRACE + ["record", "-p", "1", "-p", "2"], capture_output=True, text=True)
    assert out.returncode == 2 and "one record per process" in out.stderr


SIGNAL_PROBE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job starts
from pymtrace import cli, stopping
from pymtrace.tracee import launch
try:
    cli.main(["--version"])
except SystemExit:
    pass
assert signal.getsignal(signal.SIGINT) is stopping._stop, signal.getsignal(signal.SIGINT)
assert stopping.INHERITED_SIGINT == signal.SIG_IGN
try:
    os.kill(os.getpid(), signal.SIGINT)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
os.kill(os.getpid(), signal.SIGTERM)  # a second stop signal: ignored
print("second ignored")
sys.stdout.flush()  # before the child writes to the same pipe (else its line can come first)
# a launched command gets the SIGINT disposition pymtrace inherited, not pymtrace's handler
l = launch.Launched(["/bin/sh", "-c", "grep SigIgn /proc/$$/status"])
l.wait()
"""


def test_cli_stops_on_sigint_even_if_started_with_it_ignored():
    out = subprocess.run([PYMTRACE[0], "-c", SIGNAL_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[2:5] == ["interrupted", "second", "ignored"], out.stdout
    assert int(out.stdout.split("SigIgn:")[1].split()[0], 16) & 2  # SIGINT still ignored in the child


def test_stop_signal_inside_a_deferred_block_takes_effect_at_its_end():
    """A stop signal whose Python handler runs inside stopping.stop_deferred() (record's drain:
    a batch written but not yet counted) does not interrupt it: KeyboardInterrupt comes when
    the block ends normally. Run in a child: the handlers are process-wide."""
    probe = textwrap.dedent('''
        import os, signal
        from pymtrace import stopping
        signal.signal(signal.SIGINT, stopping._stop)
        steps = []
        try:
            with stopping.stop_deferred():
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs at once, inside
                for _ in range(1000):
                    pass
                steps.append("block finished")
            steps.append("not reached")
        except KeyboardInterrupt:
            steps.append("interrupted after")
        print("|".join(steps), stopping.stopping())
    ''')
    out = subprocess.run([PYMTRACE[0], "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "block finished|interrupted after True", out.stdout
