"""Replay saved raw samples (heapstack.py --save) through the unwinders; CPU time per sample
(process_time: robust to the shared machine's load).  usage: bench_unwind.py PKL... """
import collections
import pickle
import sys
import time

import dwflc
import shimc

for f in sys.argv[1:]:
    d = pickle.load(open(f, "rb"))
    raw = d["raw"]
    for name, cls in (("shim", shimc.Proc), ("ctypes", dwflc.Proc)):
        c0 = time.process_time()
        p = cls(d["pid"], d["maps"])
        for r in raw:
            p.unwind(*r[:3])          # first pass: loads the modules' CFI
        c1 = time.process_time()
        best = None
        for _ in range(3):
            t = time.process_time()
            fr = sum(len(p.unwind(*r[:3])[0]) for r in raw)
            dt = (time.process_time() - t) / len(raw)
            best = dt if best is None else min(best, dt)
        stacks = collections.Counter(tuple(p.unwind(*r[:3])[0]) for r in raw)
        pcs = {pc for k in stacks for pc in k}
        t = time.process_time()
        for pc in pcs:
            p.symbolize(pc)
        ds = time.process_time() - t
        t = time.process_time()
        for pc in pcs:
            p.symbolize(pc)       # cached
        dc = time.process_time() - t
        print(f"{f} [{name}]: {len(raw)} samples, {fr / len(raw):.1f} frames/sample; first pass "
              f"{(c1 - c0) * 1e3:.0f} ms; unwind {best * 1e6:.1f} us/sample "
              f"({best * 1e6 / (fr / len(raw)):.2f} us/frame); {len(stacks)} distinct stacks; "
              f"symbolize {len(pcs)} pcs {ds * 1e3:.0f} ms cold, {dc * 1e6 / len(pcs):.2f} us/pc cached")
