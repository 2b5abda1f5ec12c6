#!/usr/bin/env python3
"""What tracing a launched command adds to its run, pymtrace's paths beside heaptrack (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/launch_bench.py [--rounds 3] [--modes M,...]
                                                             [--programs P,...] [--markdown]

Programs (bench/interposer_bench.py's real programs, and the storm): a python3 json loop, a
sqlite3 script (20,000 INSERTs, 2 indexes, 2 queries), a C++ std::map<std::string,
std::vector<int>> program (g++ -O2), `gcc -O2 -c` (gcc, cc1, as: --follow-forks for
record) and bench/storm.c's single-thread malloc(64)+free storm (2M pairs).

Modes: untraced; record (`pymtrace record -- CMD`: the interposer); record-uprobes (`--via
uprobes`); heap (`pymtrace heap -- CMD`, default sampling); heap-uprobes (`--via uprobes`);
heaptrack (`heaptrack -o FILE CMD`: every call with its stack). Each mode runs the program
and /bin/true in every round, the order rotating from round to round.

The program's own time apart from the tool's start-up and end: a tool's run of /bin/true
(the same options) is its fixed cost, reported as "start-up", and "added" is (tool's run of
the program - its run of /bin/true) - (the same untraced), min and median over the rounds
(a round's difference: its own pair). The storm times itself: ns added per call. Only ratios
inside one run mean anything: the machine is shared.
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import build_c, print_table
from interposer_bench import real_commands, storm_ns

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "pymtrace"]
MODES = ("untraced", "record", "record-uprobes", "heap", "heap-uprobes", "heaptrack")
FOLLOW = {"gcc -O2 -c"}  # programs whose work is done by children


def tool_argv(mode, program, out):
    follow = ["--follow-forks"] if program in FOLLOW else []
    if mode == "untraced":
        return []
    if mode.startswith("record"):
        via = ["--via", "uprobes"] if mode.endswith("uprobes") else []
        return [*PY, "record", "--json", "--force", *via, *follow, "-o", out, "--"]
    if mode in ("heap", "heap-uprobes"):
        via = ["--via", "uprobes"] if mode.endswith("uprobes") else []
        return [*PY, "heap", "-q", "--force", *via, "-o", out + ".pb.gz", "--"]
    return ["heaptrack", "-o", out]


def run(mode, program, argv, tmp):
    """(wall seconds, stdout, calls recorded or None) of ARGV under MODE."""
    out = os.path.join(tmp, "out")
    cmd = tool_argv(mode, program, out) + argv
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-400:]}")
    for f in os.listdir(tmp):
        if f.startswith("out") or f.startswith("heaptrack"):
            os.unlink(os.path.join(tmp, f))
    calls = json.loads(proc.stderr.strip().splitlines()[-1])["entries"] if mode.startswith("record") else None
    return wall, proc.stdout, calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--programs", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--pairs", type=int, default=2_000_000, help="storm pairs")
    ap.add_argument("--scale", type=int, default=5, help="the real programs' work, times interposer_bench's")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m != "heaptrack" or shutil.which("heaptrack")]
    if "untraced" not in modes:
        modes.insert(0, "untraced")
    rows, storm_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        programs = real_commands(tmp, args.scale)
        programs["storm"] = [build_c(tmp, "storm", ROOT / "bench" / "storm.c"), "once", str(args.pairs)]
        if args.programs:
            wanted = set(args.programs.split(","))
            programs = {k: v for k, v in programs.items() if k in wanted}
        for name, argv in programs.items():
            added = {m: [] for m in modes}
            startup = {m: [] for m in modes}
            per_call = {m: [] for m in modes}
            calls = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    t_true, _, _ = run(mode, name, ["/bin/true"], work)
                    t_prog, out, n = run(mode, name, argv, work)
                    if n:
                        calls[mode].append(n)
                    added[mode].append(t_prog - t_true)
                    startup[mode].append(t_true)
                    if name == "storm":
                        per_call[mode].append(storm_ns(out)[0] / 2)
            base = added["untraced"]
            row = {"program": name, "untraced s": f"{min(base):.3f}"}
            ht = [a - b for a, b in zip(added.get("heaptrack", []), base)]
            for mode in modes[1:]:
                extra = [a - b for a, b in zip(added[mode], base)]
                row[f"{mode} added s (min/med)"] = f"{min(extra):.3f} / {statistics.median(extra):.3f}"
                if ht and mode != "heaptrack":
                    row[f"{mode} / heaptrack"] = f"{statistics.median(extra) / max(statistics.median(ht), 1e-9):.2f}"
                row[f"{mode} start-up s"] = f"{statistics.median(startup[mode]):.2f}"
                if calls[mode]:
                    row[f"{mode} ns/call"] = f"{statistics.median(extra) / statistics.median(calls[mode]) * 1e9:.0f}"
            rows.append(row)
            if name == "storm":
                b = per_call["untraced"]
                storm_rows.append(
                    {"mode": "untraced", "ns/call (min/med)": f"{min(b):.1f} / {statistics.median(b):.1f}"}
                )
                for mode in modes[1:]:
                    v = per_call[mode]
                    storm_rows.append(
                        {
                            "mode": mode,
                            "ns/call (min/med)": f"{min(v):.1f} / {statistics.median(v):.1f}",
                            "ns added (min/med)": f"{min(v) - min(b):.1f} / {statistics.median(v) - statistics.median(b):.1f}",
                        }
                    )
    print(f"added to the program's own run (tool start-up apart), {args.rounds} interleaved rounds")
    print_table(rows, args.markdown)
    if storm_rows:
        print("\nstorm, timed by itself")
        print_table(storm_rows, args.markdown)


if __name__ == "__main__":
    main()
