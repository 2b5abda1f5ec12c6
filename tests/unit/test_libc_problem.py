"""The check `pymtrace top` and the exporter apply to every file named like a libc (any user
can map a file named libc.so.6); the system-wide runs are in
tests/live/test_top_libcs.py (same subject; a distinct name, as pytest imports test files by basename)."""


def test_libc_problem_names_what_is_wrong(tmp_path):
    """The check distinct_libcs applies to every file named like a libc."""
    from pymtrace.tracee import libc

    real = open(libc.system_libc(), "rb").read()
    assert libc.libc_problem(libc.system_libc()) is None
    cases = {
        "notelf": b"hello\n" * 50,
        "empty": b"",
        "truncated": real[:16384],
        "aarch64": real[:18] + (183).to_bytes(2, "little") + real[20:],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    assert "not a readable ELF file" in libc.libc_problem(str(tmp_path / "notelf"))
    assert "not a readable ELF file" in libc.libc_problem(str(tmp_path / "empty"))
    assert "not a readable ELF file" in libc.libc_problem(str(tmp_path / "truncated"))
    assert "not a libc for this machine" in libc.libc_problem(str(tmp_path / "aarch64"))
    assert libc.libc_problem("/usr/lib/x86_64-linux-gnu/libm.so.6") == "exports no malloc"
    note = libc.skipped_note([(str(tmp_path / "notelf"), {5, 6}, "not a readable ELF file (x)")])
    assert note == f"skipped {tmp_path / 'notelf'} (mapped by PID 5,6): not a readable ELF file (x)"
