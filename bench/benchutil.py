"""Helpers shared by the benchmark scripts in bench/ (imported as a sibling module)."""

import json
import os
import subprocess

CFLAGS = ["-O2", "-fno-builtin"]


def cpu_seconds(pid):
    """utime + stime of process PID, every thread's (/proc/PID/stat; clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def start_storm(argv, env=None):
    """bench/storm.c (built, ARGV its command line) started with ENV, its first line
    ("ready PID") read: (its Popen, reading "PAIRS SIZE" lines on stdin, and its PID)."""
    storm = subprocess.Popen([str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return storm, int(storm.stdout.readline().split()[1])


def private_libc_storm(tmp):
    """bench/storm.c started on a private copy of the system libc, so that uprobes other
    tracers attach to the system libc (by inode) cannot slow it down: the copy is named
    bench-libc.so, reached through a libc.so.6 symlink, so system-wide pymtrace instances
    (which look for files named libc.so.6 in /proc/*/maps) leave it alone too.
    Returns (the storm's Popen, its PID, the path of the libc copy it maps)."""
    import pathlib
    import shutil

    from pymtrace.tracee import libc

    tmp = pathlib.Path(tmp)
    exe = build_c(tmp, "storm", pathlib.Path(__file__).resolve().parent / "storm.c")
    system = libc.system_libc()
    shutil.copy2(system, tmp / "bench-libc.so")
    os.symlink("bench-libc.so", tmp / os.path.basename(system))
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp))
    storm, pid = start_storm([exe], env)
    path = next((m.path for m in libc.read_maps(pid) if m.path.endswith("/bench-libc.so")), None)
    if path is None:
        storm.kill()
        raise SystemExit("the storm did not load the private libc copy")
    return storm, pid, path


def private_preload_storm(tmp, library):
    """bench/storm.c started with a private copy of the allocator LIBRARY (jemalloc, ...)
    LD_PRELOADed, for the same reason private_libc_storm copies the libc: uprobes other
    tracers put on the system's copy (by inode) cannot slow it down. Returns (the storm's
    Popen, its PID, the path of the copy it maps)."""
    import pathlib
    import shutil

    from pymtrace.tracee import libc

    tmp = pathlib.Path(tmp)
    exe = build_c(tmp, "storm", pathlib.Path(__file__).resolve().parent / "storm.c")
    copy = tmp / ("bench-" + os.path.basename(library))
    shutil.copy2(library, copy)
    env = dict(os.environ, LD_PRELOAD=str(copy))
    storm, pid = start_storm([exe], env)
    path = next((m.path for m in libc.read_maps(pid) if m.path == str(copy)), None)
    if path is None:
        storm.kill()
        raise SystemExit(f"the storm did not load {copy}")
    return storm, pid, path


def interleaved(rounds, versions, names):
    """(round, name, version) in the order an interleaved benchmark runs them: every command
    NAME and version once per round, the versions' order alternating between rounds."""
    for r in range(rounds):
        order = list(versions) if r % 2 == 0 else list(reversed(versions))
        for name in names:
            for v in order:
                yield r, name, v


def versions(root, before=None):
    """{version: checkout} to compare: this tree as "after", and BEFORE (a path) if given."""
    import pathlib

    return {"before": pathlib.Path(before).resolve(), "after": root} if before else {"after": root}


def run_interleaved(rounds, versions, names, run, describe):
    """{(version, name): [result]} of RUN(version, name) over interleaved rounds (None: no
    result); DESCRIBE(result) is the rest of each round's progress line on stderr."""
    import sys

    results = {(v, n): [] for v in versions for n in names}
    for r, name, v in interleaved(rounds, versions, names):
        res = run(v, name)
        if res is not None:
            results[(v, name)].append(res)
            print(f"round {r + 1} {name:10} {v:6} {describe(res)}", file=sys.stderr)
    return results


def print_table(rows, markdown=False):
    """ROWS (dicts with the same keys) as a markdown table, or as indented JSON."""
    if markdown:
        cols = list(dict.fromkeys(c for r in rows for c in r))  # a row may lack some (no heaptrack peer)
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r.get(c, "—")) for c in cols) + " |")
    else:
        print(json.dumps(rows, indent=1))
