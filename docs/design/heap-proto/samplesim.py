"""Simulate the BPF sampler (per-thread byte counter, integer Exp draws as in heapstack.bpf.c,
blocks >= mean always taken) on the storm's size sequence and check the user-space weights
(1/p, size/p with p = 1 - exp(-size/mean)) are unbiased: many seeds, estimate / truth."""
import math
import random
import statistics
import sys



MEAN = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
N = int(sys.argv[2]) if len(sys.argv) > 2 else 200000
RUNS = int(sys.argv[3]) if len(sys.argv) > 3 else 30
LG = [round((1 << 20) * math.log2(1 + j / 1024)) for j in range(1025)]


def draw(rng):   # = heapstack.bpf.c draw_exp
    x = rng.getrandbits(32) | 1
    k = x.bit_length() - 1
    m = (x << (31 - k)) & 0x7FFFFFFF
    j, rem = m >> 21, (m >> 9) & 4095
    lgf = LG[j] + (((LG[j + 1] - LG[j]) * rem) >> 12)
    neg = (32 << 20) - ((k << 20) + lgf)
    return (((MEAN * 45426) >> 16) * neg >> 20) + 1


sizes = [16 + (i & 255) * 16 for i in range(N)] + [MEAN * 3] * 5   # a few big blocks
true_n, true_b = len(sizes), sum(sizes)
ro, rb, ns = [], [], []
for seed in range(RUNS):
    rng = random.Random(seed)
    left = draw(rng)
    en = eb = 0.0
    k = 0
    for s in sizes:
        if s >= MEAN:
            en += 1; eb += s; k += 1
            continue
        left -= s
        if left > 0:
            continue
        left = draw(rng)
        p = -math.expm1(-s / MEAN)
        en += 1 / p; eb += s / p; k += 1
    ro.append(en / true_n); rb.append(eb / true_b); ns.append(k)
print(f"mean={MEAN} N={N} runs={RUNS} samples/run~{statistics.mean(ns):.0f}")
print(f"objects: mean ratio {statistics.mean(ro):.4f} sd {statistics.stdev(ro):.4f}")
print(f"bytes:   mean ratio {statistics.mean(rb):.4f} sd {statistics.stdev(rb):.4f}")
