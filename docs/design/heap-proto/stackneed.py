"""How many bytes of stack above sp does a complete unwind need?  For each saved sample,
unwind with the copy truncated to 1, 2, 4, ... KiB and compare with the full-copy result.
usage: stackneed.py SAVED.pkl"""
import pickle
import sys

import shimc

d = pickle.load(open(sys.argv[1], "rb"))
p = shimc.Proc(d["pid"], d["maps"])
sizes = [512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536]
ok = {s: 0 for s in sizes}
n = 0
depths = []
full_lens = []
roots = {}
for tid, stack, regs, sz in d["raw"]:
    full, _ = p.unwind(tid, stack, regs)
    n += 1
    depths.append(len(full))
    full_lens.append(len(stack))
    root = p.symbolize(full[-1])[0] if full else None
    roots[root] = roots.get(root, 0) + 1
    for s in sizes:
        if s >= len(stack) or p.unwind(tid, stack[:s], regs)[0] == full:
            ok[s] += 1
print(f"{n} samples; frames min/median/max {min(depths)}/{sorted(depths)[n//2]}/{max(depths)}; "
      f"copied bytes median {sorted(full_lens)[n//2]} max {max(full_lens)}")
print("outermost frames:", roots)
print("complete unwind with a copy of:", ", ".join(f"{s//1024 if s >= 1024 else s/1024}K {100*ok[s]/n:.1f}%" for s in sizes))
