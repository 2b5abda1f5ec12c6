"""Helpers shared by the benchmark scripts in bench/ (imported as a sibling module)."""
import os
import subprocess

CFLAGS = ["-O2", "-fno-builtin"]


def build_c(tmp, name, src_path=None, source=None, flags=CFLAGS):
    """Compile a C program (a file, or SOURCE written to TMP/NAME.c) to TMP/NAME; returns its path."""
    out = os.path.join(tmp, name)
    if source is not None:
        src_path = os.path.join(tmp, name + ".c")
        with open(src_path, "w") as f:
            f.write(source)
    subprocess.run(["gcc", *flags, "-o", out, str(src_path)], check=True)
    return out
