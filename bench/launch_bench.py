#!/usr/bin/env python3
"""What tracing a launched command adds to its run, pymtrace's paths beside heaptrack (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/launch_bench.py [--rounds 3] [--modes M,...]
                                                             [--programs P,...] [--scale 5] [--markdown]

Programs (bench/interposer_bench.py's real programs, SCALE times their work, and the storm): a
python3 json loop, a sqlite3 script (INSERTs, 2 indexes, 2 queries), a C++
std::map<std::string, std::vector<int>> program (g++ -O2), `gcc -O2 -c` (gcc, cc1, as) and
bench/storm.c's single-thread malloc(64)+free storm.

Modes: untraced; record (`pymtrace record -- CMD`: the interposer); record-stacks (`record
--stacks --native -- CMD`: the interposer, a native stack per allocation, as heaptrack takes
them); record-uprobes (`--via uprobes`); heap (`pymtrace heap -- CMD`, default sampling); heap-uprobes (`--via uprobes`);
heaptrack (`heaptrack -o FILE CMD`: every call with its stack). Every round runs each mode
once, the order rotating from round to round.

The program's own run, the tool's start-up apart: the program runs under a small timer
(heap_interposer_bench.TIMER) that forks it and reports its wall and CPU time from the fork
to its exit; pymtrace runs `-- TIMER CMD` with --follow-forks (the program is the timer's
child). heaptrack cannot be given the timer (it traces the process it starts, not that
one's children), so it runs inside the timer, and its run of /bin/true in the same round is
taken off as its start-up and end. "added" is the median over rounds of the tool's time
minus untraced's in the same round; ns/call divides it by the calls `record` recorded (CPU
ns/call: the program's CPU time the same way, which a loaded machine disturbs less). The
storm also times itself: ns added per call. Only ratios inside one run mean anything: the
machine is shared.
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

from benchutil import build_c, print_table
from heap_interposer_bench import TIMER
from interposer_bench import real_commands, storm_ns

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "pymtrace"]
MODES = ("untraced", "record", "record-stacks", "record-uprobes", "heap", "heap-uprobes", "heaptrack")


def tool_argv(mode, out):
    via = ["--via", "uprobes"] if mode.endswith("-uprobes") else []
    if mode.startswith("record"):
        # record-stacks: every allocation's native stack, in-process (as heaptrack records them)
        stacks = ["--stacks", "--native"] if mode == "record-stacks" else []
        return [*PY, "record", "--json", "--force", "--follow-forks", *stacks, *via, "-o", out, "--"]
    return [*PY, "heap", "-q", "--force", "--follow-forks", "--allow-drops", *via, "-o", out + ".pb.gz", "--"]


def run(mode, timer, argv, tmp):
    """(program wall s, program CPU s, its stdout, calls recorded or None) of ARGV under MODE."""
    result = os.path.join(tmp, "timer.out")
    out = os.path.join(tmp, "out")
    timed = [timer, result, *argv]
    if mode == "untraced":
        cmd = timed
    elif mode == "heaptrack":
        cmd = [timer, result, "heaptrack", "-o", out, *argv]
    else:
        cmd = tool_argv(mode, out) + timed
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-400:]}")
    calls = None
    if mode.startswith("record"):
        calls = json.loads(proc.stderr.strip().splitlines()[-1])["entries"]
    for f in os.listdir(tmp):
        if f.startswith("out") or f.startswith("heaptrack"):
            os.unlink(os.path.join(tmp, f))
    with open(result) as f:
        wall, cpu, _status = map(int, f.read().split())
    return wall / 1e9, cpu / 1e9, proc.stdout, calls


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
        # the timer maps libstdc++: record/heap --via uprobes probe operator new from its start, as
        # a followed child's new program is not probed itself (docs/record.md, --follow-forks)
        timer = build_c(tmp, "timer", source=TIMER, flags=["-O2", "-Wl,--no-as-needed", "-lstdc++"])
        programs = real_commands(tmp, args.scale)
        programs["storm"] = [build_c(tmp, "storm", ROOT / "bench" / "storm.c"), "once", str(args.pairs)]
        if args.programs:
            wanted = args.programs.split(",")  # names, or their beginnings ("C++ map")
            programs = {k: v for k, v in programs.items() if any(k.startswith(w) for w in wanted)}
        for name, argv in programs.items():
            wall = {m: [] for m in modes}
            cpu = {m: [] for m in modes}
            per_call = {m: [] for m in modes}
            calls = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    w, c, out, n = run(mode, timer, argv, work)
                    if mode == "heaptrack":
                        w -= run(mode, timer, ["/bin/true"], work)[0]
                    wall[mode].append(w)
                    cpu[mode].append(c)
                    if n:
                        calls[mode].append(n)
                    if name == "storm":
                        per_call[mode].append(storm_ns(out)[0] / 2)
            base = wall["untraced"]
            row = {"program": name, "untraced s (median)": f"{statistics.median(base):.3f}"}
            ht = [a - b for a, b in zip(wall.get("heaptrack", []), base)]
            for mode in modes[1:]:
                extra = [a - b for a, b in zip(wall[mode], base)]
                row[f"{mode} added s (min/med)"] = f"{min(extra):.3f} / {statistics.median(extra):.3f}"
                if ht and mode != "heaptrack" and statistics.median(ht) > 0:
                    row[f"{mode} / heaptrack"] = f"{statistics.median(extra) / statistics.median(ht):.2f}"
                if calls[mode]:
                    row[f"{mode} ns/call"] = f"{statistics.median(extra) / statistics.median(calls[mode]) * 1e9:.0f}"
                    # the program's CPU time (a trap's kernel time is its own): less disturbed by a loaded machine
                    added_cpu = statistics.median(a - b for a, b in zip(cpu[mode], cpu["untraced"]))
                    row[f"{mode} CPU ns/call"] = f"{added_cpu / statistics.median(calls[mode]) * 1e9:.0f}"
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
    print(f"added to the program's own wall time (tool start-up apart), {args.rounds} interleaved rounds")
    print_table(rows, args.markdown)
    if storm_rows:
        print("\nstorm, timed by itself")
        print_table(storm_rows, args.markdown)


if __name__ == "__main__":
    main()
