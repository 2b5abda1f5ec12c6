"""Helpers shared by the benchmark scripts in bench/ (imported as a sibling module)."""

import json
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


def uprobe_pids(path):
    """PIDs of other processes with BPF uprobes on PATH or its real path (bpftool perf list),
    as a set; None if bpftool could not tell."""
    try:
        out = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True, timeout=20).stdout
        entries = json.loads(out or "[]")
    except Exception:
        return None
    names = (path, os.path.realpath(path))
    return {e.get("pid") for e in entries if e.get("filename") in names and e.get("pid") != os.getpid()}


def print_table(rows, markdown=False):
    """ROWS (dicts with the same keys) as a markdown table, or as indented JSON."""
    if markdown:
        cols = list(rows[0])
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    else:
        print(json.dumps(rows, indent=1))
