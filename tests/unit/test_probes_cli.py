"""`pymtrace probes` without BPF: help, probe globs, --list (the stream on real BPF:
tests/live/test_probes.py)."""

from support.cli import run_pymtrace


def test_probes_help_has_examples_and_overhead():
    proc = run_pymtrace("probes", "--help")
    assert proc.returncode == 0 and "OVERHEAD" in proc.stdout and "examples:" in proc.stdout


def test_probe_globs_and_exit_status():
    from pymtrace.sources import usdt
    from pymtrace.tracee.proc import exit_status

    assert usdt.match_probe("memory_sbrk_more", ["sbrk_*"])
    assert usdt.match_probe("memory_sbrk_more", ["memory_sbrk_more"])
    assert not usdt.match_probe("memory_heap_new", ["sbrk_*", "arena*"])
    assert usdt.match_probe("memory_heap_new", [])
    assert exit_status(0) == 0 and exit_status(3) == 3 and exit_status(-6) == 134


def test_probes_list_shows_sites_and_specs(sdt_libc):
    from pymtrace.sources import usdt
    from pymtrace.tracee import libc

    _, path = sdt_libc
    proc = run_pymtrace("probes", "--list", "--libc", path)
    assert proc.returncode == 0, proc.stderr
    probes = libc.malloc_probes(path)
    assert f"{path}: {len({p.name for p in probes})} malloc probes at {len(probes)} sites" in proc.stdout
    for p in probes:  # e.g. memory_mallopt_mxfast new=8@%rax old=8@global_max_fast(%rip)
        names = usdt.arg_names(p.name, len(p.arg_specs))
        line = f"{p.address:#08x} {p.name} " + " ".join(f"{n}={a}" for n, a in zip(names, p.arg_specs))
        assert line.strip() in proc.stdout
