"""CPU cost of target/unwind.py on real dumped stacks (tests/support/workloads/heap_selfstack*):
per sample and per frame for unwinding, without the native unwind cache (libdwfl every time)
and with it (a hit: the usual case, a stack seen before), and per pc for symbolizing (cold
and cached).

    python bench/unwind_bench.py [--rounds 5] [--samples 5000]

CPU time (time.process_time), best and median of interleaved rounds; run from the tree root.
"""

import argparse
import os
import pathlib
import statistics
import struct
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pymtrace.tracee import unwind  # noqa: E402

WORKLOADS = ROOT / "tests" / "support" / "workloads"
FLAGS = ["-O2", "-fomit-frame-pointer", "-fno-builtin", "-I", str(WORKLOADS)]


def dump(tmp, argv, env=None):
    """Run a selfstack workload; (image, tid, regs, stack) of its dumped leaf."""
    path = os.path.join(tmp, "dump")
    if os.path.exists(path):
        os.unlink(path)
    proc = subprocess.Popen([*argv, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    proc.stdout.readline()
    image = unwind.ProcessImage(proc.pid)
    proc.communicate("\n")
    data = pathlib.Path(path).read_bytes()
    (length,) = struct.unpack_from("<Q", data, 64)
    return image, proc.pid, struct.unpack_from("<8Q", data), data[72 : 72 + length]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=5000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        c, cxx = os.path.join(tmp, "c"), os.path.join(tmp, "cxx")
        subprocess.run(["gcc", *FLAGS, "-o", c, WORKLOADS / "heap_selfstack.c"], check=True)
        subprocess.run(["g++", *FLAGS, "-o", cxx, WORKLOADS / "heap_selfstack_cxx.cpp"], check=True)
        cases = {"C main>a>b>leaf": dump(tmp, [c, "exe"]), "C++ build>make": dump(tmp, [cxx])}
        times = {(name, cached): [] for name in cases for cached in (False, True)}
        frames = {}
        for _ in range(args.rounds):
            for name, cached in times:
                image, tid, regs, stack = cases[name]
                image.enable_cache(cached)
                start = time.process_time()
                for _ in range(args.samples):
                    locs, complete = image.unwind(tid, regs, stack, len(stack))
                times[name, cached].append((time.process_time() - start) / args.samples)
                frames[name] = len(locs)
                assert complete
        for (name, cached), t in times.items():
            best, med = min(t), statistics.median(t)
            print(
                f"unwind {name} {'cache hit' if cached else 'no cache '}: {frames[name]} frames, "
                f"{best * 1e6:.2f} us/sample best ({med * 1e6:.2f} median), {best * 1e6 / frames[name]:.2f} us/frame"
            )
        for name, (image, tid, regs, stack) in cases.items():
            symbolizer = unwind.Symbolizer()
            symbolizer.add(image)
            locs, _ = image.unwind(tid, regs, stack, len(stack))
            start = time.process_time()
            for loc in locs:
                symbolizer.frames(loc)
            cold = time.process_time() - start
            start = time.process_time()
            for _ in range(1000):
                for loc in locs:
                    symbolizer.frames(loc)
            cached = (time.process_time() - start) / 1000 / len(locs)
            print(f"symbolize {name}: cold {cold * 1e3:.1f} ms for {len(locs)} pcs, cached {cached * 1e6:.2f} us/pc")


if __name__ == "__main__":
    main()
