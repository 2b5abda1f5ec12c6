"""`pymtrace record`'s arguments turned into the recorder's typed options, and the options'
own checks (no BPF)."""

import argparse
import mmap

import pytest

from pymtrace.commands import record
from pymtrace.errors import PymtraceError
from pymtrace.recorder.options import RecordOptions

PAGE = mmap.PAGESIZE


def options(*argv):
    parser = argparse.ArgumentParser()
    record.configure(parser)
    return record.options(parser.parse_args(list(argv)))


def test_defaults_of_a_launched_command():
    got = options("--", "./prog", "-x")
    assert got == RecordOptions(pages=(32 << 20) // PAGE, cmd=("./prog", "-x"))
    assert got.format == "mtrace-bin" and got.progress


def test_every_flag_reaches_its_option():
    got = options(
        "-p", "42", "-o", "t.bin", "--force", "--format", "mtrace-text", "--buffer-size", "1M",
        "--poll-interval", "5", "--duration", "2.5", "--allow-drops", "--follow-forks",
        "--libc", "/lib/libc.so.6", "--json", "-q",
    )  # fmt: skip
    assert got == RecordOptions(
        pages=(1 << 20) // PAGE,
        pid=42,
        output="t.bin",
        force=True,
        format="mtrace-text",
        poll_interval_ms=5.0,
        duration_s=2.5,
        allow_drops=True,
        follow_forks=True,
        libc="/lib/libc.so.6",
        json=True,
        quiet=True,
    )
    assert not got.progress
    assert options("--stacks", "-p", "1").stacks
    assert options("--stacks", "--native", "-p", "1").native


def test_output_name_picks_the_format():
    assert options("-o", "app.parquet", "-p", "1").format == "parquet"
    assert options("-o", "app.parquet", "--format", "mtrace-bin", "-p", "1").format == "mtrace-bin"


def test_to_becomes_a_network_target():
    got = options("--to", "127.0.0.1:7300", "--spool-memory", "1M", "--send-timeout", "4", "-q", "-p", "1")
    net = got.network
    assert (net.address, net.spool_memory, net.send_timeout) == (("127.0.0.1", 7300), 1 << 20, 4.0)
    assert net.config.ssl_context is None and got.output is None


@pytest.mark.parametrize(
    "argv, message",
    [
        ((), r"give -p PID or -- CMD ARGS\.\.\."),
        (("-p", "1", "--", "true"), "give either -p PID or -- CMD, not both"),
        (("--stacks", "--format", "mtrace-text", "-p", "1"), "--stacks needs --format mtrace-bin or parquet"),
        (("--native", "-p", "1"), "--native chooses how --stacks shows Python processes"),
        (("--to", "127.0.0.1:1", "-o", "x", "-p", "1"), "no -o or --format with it"),
        (("--to", "127.0.0.1:1", "--stacks", "-p", "1"), "--stacks cannot be combined with --to"),
        (("--web-config", "x", "-p", "1"), "--web-config is for --to"),
        (("--to", "10.0.0.1:1", "-p", "1"), "plain TCP is allowed only to loopback"),
    ],
)
def test_contradictions_are_refused(argv, message):
    with pytest.raises(PymtraceError, match=message):
        options(*argv)


def _script(tmp_path, name, line):
    path = tmp_path / name
    path.write_text(f"{line}\nprint(1)\n")
    path.chmod(0o755)
    return str(path)


def test_which_commands_run_cpython(tmp_path):
    """--stacks keeps a CPython program on uprobes (its Python frames are read in BPF): the
    interpreter itself, a #! script naming it directly or through env (options and
    assignments skipped); not a shell, a C program, or env running one."""
    import sys

    from pymtrace.sources.interposer import runs_python

    python = sys.executable  # a CPython (the venv's: a symlink to one that exports _PyRuntime)
    assert runs_python([python, "-c", "1"])
    assert runs_python([_script(tmp_path, "direct", f"#!{python} -u")])
    assert runs_python([_script(tmp_path, "env", f"#!/usr/bin/env {python}")])
    assert runs_python(["env", "-i", "A=b", python, "-c", "1"])
    assert not runs_python(["/bin/sh", "-c", "true"])
    assert not runs_python([_script(tmp_path, "shell", "#!/bin/sh")])
    assert not runs_python(["env", "/bin/true"])
    assert not runs_python([str(tmp_path / "missing")])


def test_stacks_through_uprobes_for_cpython_unless_native():
    """choose(): --stacks on a CPython program goes through uprobes, saying why; --native
    records it in-process; a C program with --stacks is in-process."""
    import sys

    from pymtrace.recorder import inprocess

    path, why = inprocess.choose(RecordOptions(pages=8, cmd=(sys.executable, "-c", "1"), stacks=True))
    assert path == "uprobes" and "Python program's frames in BPF" in why
    assert inprocess.choose(RecordOptions(pages=8, cmd=(sys.executable, "-c", "1"), stacks=True, native=True)) == (
        "interposer",
        None,
    )
    assert inprocess.choose(RecordOptions(pages=8, cmd=("/bin/true",), stacks=True)) == ("interposer", None)
