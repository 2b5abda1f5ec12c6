"""pymtrace.trace.files: every output file is created without following symlinks, at an
unguessable temporary name, mode 0600; an existing output is refused unless force."""

import os
import stat

import pytest

from pymtrace.errors import PymtraceError
from pymtrace.trace import files as outfiles


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_open_exclusive_never_follows_symlinks(tmp_path):
    target = tmp_path / "target"
    target.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(PymtraceError):
        outfiles.open_exclusive(str(link))
    fd = outfiles.open_exclusive(str(link), force=True)  # replaces the link, not its target
    os.close(fd)
    assert target.read_text() == "x" and not link.is_symlink()
    assert mode(link) == 0o600
    (tmp_path / "mtrace.out.5").write_text("")
    (tmp_path / "mtrace.out.5.1").write_text("")
    assert outfiles.default_name(str(tmp_path / "mtrace.out.5")) == str(tmp_path / "mtrace.out.5.2")


def test_open_exclusive_force_on_a_file_it_cannot_remove_is_one_error():
    with pytest.raises(PymtraceError, match="cannot create /proc/version"):
        outfiles.open_exclusive("/proc/version", force=True)


def test_atomic_output_mode_refusal_and_force(tmp_path):
    out = tmp_path / "out.bin"
    with outfiles.atomic_output(str(out)) as f:
        f.write(b"one")
    assert out.read_bytes() == b"one" and mode(out) == 0o600
    with pytest.raises(PymtraceError, match="exists; choose another file or use --force"):
        with outfiles.atomic_output(str(out)) as f:
            f.write(b"two")
    assert out.read_bytes() == b"one"
    with outfiles.atomic_output(str(out), force=True, mode="w") as f:
        f.write("two")
    assert out.read_text() == "two" and mode(out) == 0o600
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary left


def test_atomic_output_symlink_at_target_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    link = tmp_path / "out.wl"
    link.symlink_to(victim)
    with pytest.raises(PymtraceError, match="exists"):
        with outfiles.atomic_output(str(link)) as f:
            f.write(b"data")
    assert link.is_symlink() and victim.read_text() == "precious"
    with outfiles.atomic_output(str(link), force=True) as f:
        f.write(b"data")
    assert not link.is_symlink() and link.read_bytes() == b"data" and mode(link) == 0o600
    assert victim.read_text() == "precious" and mode(victim) == 0o644


def test_atomic_output_target_appearing_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    with pytest.raises(PymtraceError, match="exists"):
        with outfiles.atomic_output(str(out)) as f:
            out.symlink_to(victim)  # planted while the output is being written
            f.write(b"data")
    assert out.is_symlink() and victim.read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["out", "victim"]


def test_atomic_output_error_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with outfiles.atomic_output(str(out)) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with pytest.raises(PymtraceError, match="is a directory"):
        with outfiles.atomic_output(str(tmp_path), force=True):
            pass
    with pytest.raises(PymtraceError, match="cannot create"):
        with outfiles.atomic_output(str(tmp_path / "missing" / "out")):
            pass


def test_side_files_of_a_trace_by_one_rule(tmp_path):
    """A trace's stack table and maps are named by files.side_file: the trace's path with the
    side file's suffix, whatever the trace's name (a suffix of its own, dots, a directory)."""
    from pymtrace.trace import files, mappings, stacktable

    for trace in (tmp_path / "app.trace", tmp_path / "run.1.parquet", tmp_path / "d.x" / "mtrace.out.42"):
        trace = str(trace)
        assert files.side_file(trace, ".stacks") == trace + ".stacks"
        assert stacktable.table_path(trace) == files.side_file(trace, stacktable.SUFFIX) == trace + ".stacks"
        assert mappings.side_path(trace) == files.side_file(trace, mappings.SUFFIX) == trace + ".maps"
