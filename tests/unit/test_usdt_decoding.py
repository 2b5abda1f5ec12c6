"""pymtrace.sources.usdt: USDT argument decoding, generated code, libc status and memory reads (no BPF)."""

import os
import subprocess

import pytest

from pymtrace.sources import usdt
from pymtrace.tracee import libc
from pymtrace.tracee.libc import Symbol, UsdtProbe

TRICKY = {
    "memory_mallopt_mxfast",
    "memory_mallopt_trim_threshold",
    "memory_mallopt_top_pad",
    "memory_mallopt_mmap_threshold",
    "memory_mallopt_mmap_max",
    "memory_mallopt_perturb",
    "memory_mallopt_arena_test",
    "memory_mallopt_arena_max",
    "memory_tunable_tcache_max_bytes",
    "memory_tunable_tcache_count",
    "memory_tunable_tcache_unsorted_limit",
}


@pytest.mark.parametrize(
    "text,kind,size,signed,reg",
    [
        ("-4@%esi", "reg", 4, True, "si"),
        ("8@%rdi", "reg", 8, False, "di"),
        ("-8@%r15", "reg", 8, True, "r15"),
        ("-4@%r9d", "reg", 4, True, "r9"),
        ("1@%ah", "reg", 1, False, "ax"),
        ("%rax", "reg", 8, False, "ax"),  # old notes without a size
    ],
)
def test_parse_register_args(text, kind, size, signed, reg):
    a = usdt.parse_arg(text)
    assert (a.kind, a.size, a.signed, a.reg) == (kind, size, signed, reg)


def test_parse_memory_args():
    a = usdt.parse_arg("8@24(%rsp)")
    assert (a.kind, a.reg, a.disp, a.symbols, a.rip) == ("mem", "sp", 24, (), False)
    a = usdt.parse_arg("-4@-12(%rbp)")
    assert (a.size, a.signed, a.reg, a.disp) == (4, True, "bp", -12)
    a = usdt.parse_arg("8@16+mp_(%rip)")
    assert (a.rip, a.disp, a.symbols, a.reg) == (True, 16, ((1, "mp_"),), "")
    a = usdt.parse_arg("8@global_max_fast(%rip)")
    assert (a.rip, a.disp, a.symbols) == (True, 0, ((1, "global_max_fast"),))
    a = usdt.parse_arg("-4@72+mp_(%rip)")
    assert (a.size, a.signed, a.disp) == (4, True, 72)
    a = usdt.parse_arg("8@8(%rax,%rbx,8)")
    assert (a.reg, a.index, a.scale, a.disp) == ("ax", "bx", 8, 8)
    a = usdt.parse_arg("4@$-5")
    assert (a.kind, a.imm) == ("imm", -5)


def test_rip_relative_code_uses_probe_ip():
    symtab = {"mp_": Symbol("mp_", 0x1CF340, 136)}
    spec = usdt.parse_arg("8@16+mp_(%rip)")
    code = usdt.arg_code(spec, 1, 0x909E3, symtab)
    # runtime address = ctx->ip + (mp_ + 16 - probe address)
    assert f"ctx->ip + ({0x1CF340 + 16 - 0x909E3}LL)" in code
    assert "pm_probe_read_user" in code and "u64 v" in code and "flags |= 2" in code
    code = usdt.arg_code(usdt.parse_arg("-4@72+mp_(%rip)"), 2, 0x909E3, symtab)
    assert "s32 v" in code and "(u64)(s32)v" in code
    assert usdt.arg_code(usdt.parse_arg("-4@%eax"), 0, 0, {}) == "a0 = (u64)(s32)(ctx->ax);"


def test_unresolvable_symbol_is_reported_not_guessed(monkeypatch):
    probe = UsdtProbe("libc", "memory_mallopt_mxfast", 0x1000, 0, "8@%rax 8@global_max_fast(%rip)")
    monkeypatch.setattr(libc, "malloc_probes", lambda path: [probe])
    monkeypatch.setattr(libc, "symbols", lambda path: {})
    sites, warnings = usdt.build_sites(["/x/libc.so.6"])
    assert len(sites) == 1 and sites[0].unresolved and 1 in sites[0].unresolved
    assert any("global_max_fast" in w and "not decoded" in w for w in warnings)
    assert "pm_probe_read_user" not in sites[0].code  # no read from a made-up address
    assert "flags |= 2;" in sites[0].code


def test_memory_address_of_operand():
    symtab = {"mp_": Symbol("mp_", 0x1000, 136)}
    spec = usdt.parse_arg("8@16+mp_(%rip)")
    assert usdt.memory_address(spec, 0x500, symtab, 0x7F0000000000) == 0x7F0000000000 + 0x1010
    assert usdt.memory_address(usdt.parse_arg("8@%rax"), 0x500, symtab, 0) is None


def test_sdt_libc_every_site_decodes(sdt_libc):
    _, path = sdt_libc
    probes = libc.malloc_probes(path)
    names = {p.name for p in probes}
    assert len(names) >= 29 and TRICKY <= names
    sites, warnings = usdt.build_sites([path])
    assert warnings == []
    assert len(sites) == len(probes)  # every note, including repeated names
    for s in sites:
        if s.name in TRICKY:
            assert "ctx->ip + (" in s.code, s.name  # the RIP-relative global is read
        assert not s.unresolved


def test_libc_without_probes_reason():
    system = libc.system_libc()
    if system is None or libc.malloc_probes(system):
        pytest.skip("the system libc carries probes")
    st = usdt.libc_status(system)
    assert st["probes"] == 0
    assert st["reason"] == f"libc {system} has no USDT probes (Debian builds glibc without --enable-systemtap)"


def test_read_params_of_a_live_process(sdt_libc, cbuild):
    """Current parameters read from process memory at the probes' operands (no BPF)."""
    prefix, path = sdt_libc
    work = subprocess.Popen(prefix + [cbuild("glibc_idle")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout.readline().startswith("ready")
        params = usdt.read_params(work.pid, path)
    finally:
        work.kill()
        work.wait()
    if os.geteuid() != 0 and not params:
        pytest.skip("cannot read another process's memory")
    assert params["mmap_threshold"] == 1 << 20 and params["trim_threshold"] == 64 << 20
    assert params["top_pad"] == 131072 and params["mxfast"] == 128 and params["tcache_count"] == 7
