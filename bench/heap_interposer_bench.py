#!/usr/bin/env python3
"""`pymtrace heap -- CMD` at the default sampling, in-process (the interposer) and through
uprobes (`--via uprobes`), against untraced, on four real programs (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/heap_interposer_bench.py [--rounds 3] [--markdown]

The programs are interposer_bench.py's --real ones, their work times --scale (default 5: long
enough that pymtrace's own work while they run, unwinding the first stacks of each process,
is not most of it): python3 (a json loop), sqlite3 (INSERTs, 2 indexes, 2 queries), a C++
std::map<std::string, std::vector<int>> program and gcc -O2 -c (gcc, cc1, as). Each runs under a small timer (built here) that forks it and
reports its wall time and CPU time (user + system, its children's included) from the fork to
its exit: the program's own work, pymtrace's start-up (compiling the BPF program, attaching)
apart. Every mode runs the timer the same way; heap gets --follow-forks (the program is the
timer's child; gcc's cc1 and as are gcc's). Modes, each once per round, the order rotating
from round to round (a loaded machine: only ratios inside one run mean anything):

  untraced     the timer alone
  interposer   pymtrace heap --follow-forks -- TIMER CMD (the default: in-process sampling)
  uprobes      the same with --via uprobes

Reported per program: median wall and CPU seconds per mode, and each heap mode's slowdown
against untraced (of the medians), the samples heap took, and the load average.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchutil import build_c, print_table
from interposer_bench import real_commands

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pymtrace.sources import interposer as I  # noqa: E402

PY = [sys.executable, "-m", "pymtrace"]
MODES = ("untraced", "interposer", "uprobes")
TIMER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* timer OUT CMD ARGS...: runs CMD, writes "wall_ns cpu_ns status" to OUT */
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    pid_t pid = fork();
    if (pid == 0) {
        execvp(argv[2], argv + 2);
        _exit(127);
    }
    int status = 0;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) != pid) return 3;
    clock_gettime(CLOCK_MONOTONIC, &b);
    long long wall = (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
    long long cpu = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000000LL
                  + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1000LL;
    char line[96];
    int n = snprintf(line, sizeof line, "%lld %lld %d\n", wall, cpu, status);
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || write(fd, line, n) != n) return 4;
    close(fd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
"""


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(mode, timer, argv, tmp):
    """(wall s, CPU s, heap's sample count or None) of ARGV under MODE."""
    result = os.path.join(tmp, "timer.out")
    timed = [timer, result, *argv]
    samples = None
    if mode == "untraced":
        subprocess.run(timed, capture_output=True, check=True, cwd=tmp)
    else:
        out = os.path.join(tmp, "heap.folded")
        args = [*PY, "heap", "--follow-forks", "--allow-drops", "--force", "-o", out]
        args += ["--via", "uprobes"] if mode == "uprobes" else []
        proc = subprocess.run([*args, "--", *timed], capture_output=True, text=True, cwd=tmp, env=_env())
        if proc.returncode != 0:
            raise SystemExit(f"heap failed ({mode}, {argv[0]}):\n{proc.stderr}")
        via = "via uprobes" if mode == "uprobes" else "via interposer"
        if via not in proc.stderr.splitlines()[0]:
            raise SystemExit(f"heap did not run {via}: {proc.stderr.splitlines()[0]}")
        line = next(ln for ln in proc.stderr.splitlines() if "samples:" in ln)
        samples = int(line.split("samples:")[1].split(",")[0])
    with open(result) as f:
        wall, cpu, _status = map(int, f.read().split())
    return wall / 1e9, cpu / 1e9, samples


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=int, default=5, help="times interposer_bench's work (gcc's apart)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = []
    loads = [load()]
    with tempfile.TemporaryDirectory() as tmp:
        timer = build_c(tmp, "timer", source=TIMER, flags=["-O2"])
        I.library()  # built before the first round
        for name, argv in real_commands(tmp, args.scale).items():
            got = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                    got[mode].append(run(mode, timer, argv, tmp))
            base_wall = statistics.median(w for w, _, _ in got["untraced"])
            base_cpu = statistics.median(c for _, c, _ in got["untraced"])
            row = {"program": name}
            for mode in MODES:
                wall = statistics.median(w for w, _, _ in got[mode])
                cpu = statistics.median(c for _, c, _ in got[mode])
                row[f"{mode} wall / CPU s"] = f"{wall:.3f} / {cpu:.3f}"
                if mode != "untraced":
                    row[f"{mode} slowdown (wall, CPU)"] = f"{wall / base_wall:.2f}x, {cpu / base_cpu:.2f}x"
                    counts = [s for _, _, s in got[mode]]
                    row[f"{mode} samples"] = f"{min(counts)}-{max(counts)}"
            rows.append(row)
            loads.append(load())
    print(
        f"heap -- CMD at the default sampling, {args.rounds} interleaved rounds, medians, scale {args.scale}; "
        f"load {' -> '.join(loads)}"
    )
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
