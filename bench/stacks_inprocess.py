#!/usr/bin/env python3
"""record --stacks: a stack per allocating call, unwound in-process or copied by BPF (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/stacks_inprocess.py [--rounds 3] [--pairs 200000]

bench/native/deep_calls.c makes N malloc(64)+free pairs, each malloc D frames deep (5, 20),
and times itself (ns per pair). Modes, interleaved: untraced; in-process unwinding
(bench/native/unwind_preload.c preloaded: libgcc's _Unwind_Backtrace on every malloc, what an
interposer would do without a cache); `pymtrace record` (the interposer, no stacks);
`pymtrace record --stacks` (the interposer: libunwind's cached unw_backtrace in the process,
stacks interned there); `pymtrace record --stacks --via uprobes` (each allocation's stack
copied by BPF, unwound by pymtrace). Reported: min and median ns per pair, and ns added per pair.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "bench" / "native"
PY = [sys.executable, "-m", "pymtrace"]


def ns_per_pair(stdout):
    return float(stdout.split()[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=200_000)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        prog = os.path.join(tmp, "deep")
        lib = os.path.join(tmp, "unwind.so")
        subprocess.run(["gcc", "-O2", "-o", prog, NATIVE / "deep_calls.c"], check=True)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, NATIVE / "unwind_preload.c", "-ldl"], check=True)
        out = os.path.join(tmp, "t")
        modes = {
            "untraced": lambda argv: (argv, {}),
            "in-process unwind": lambda argv: (argv, {"LD_PRELOAD": lib}),
            "record (interposer)": lambda argv: ([*PY, "record", "-q", "--force", "-o", out, "--", *argv], {}),
            "record --stacks (interposer)": lambda argv: (
                [*PY, "record", "-q", "--force", "--stacks", "-o", out, "--", *argv],
                {},
            ),
            "record --stacks (uprobes)": lambda argv: (
                [
                    *PY,
                    "record",
                    "-q",
                    "--force",
                    "--stacks",
                    "--via",
                    "uprobes",
                    "--allow-drops",
                    "-o",
                    out,
                    "--",
                    *argv,
                ],
                {},
            ),
        }
        for depth in (5, 20):
            argv = [prog, str(args.pairs), str(depth)]
            times = {m: [] for m in modes}
            names = list(modes)
            for r in range(args.rounds):
                for m in names[r % len(names) :] + names[: r % len(names)]:
                    cmd, extra = modes[m](argv)
                    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, **extra}, check=True)
                    times[m].append(ns_per_pair(proc.stdout))
            base = times["untraced"]
            print(f"depth {depth}, {args.pairs} pairs, {args.rounds} interleaved rounds: ns per pair (min / median)")
            for m, t in times.items():
                added = f"  +{min(t) - min(base):.0f} / +{statistics.median(t) - statistics.median(base):.0f}"
                print(f"  {m:28s} {min(t):9.1f} / {statistics.median(t):9.1f}" + ("" if m == "untraced" else added))


if __name__ == "__main__":
    main()
