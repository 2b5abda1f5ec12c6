"""The integer Exp(mean) draw with linear interpolation inside the 1024-entry log2 table
(heapstack.bpf.c draw_exp): distribution near 0 (what small allocations see) and mean."""
import math
import random

MEAN = 65536
LG = [round(65536 * 16 * math.log2(1 + j / 1024)) for j in range(1025)]  # 20 fractional bits


def draw(x):
    x |= 1
    k = x.bit_length() - 1
    m = (x << (31 - k)) & 0x7FFFFFFF          # mantissa, 31 bits
    j, rem = m >> 21, (m >> 9) & 4095          # top 10 bits, next 12 bits
    lgf = LG[j] + (((LG[j + 1] - LG[j]) * rem) >> 12)
    neg = (32 << 20) - ((k << 20) + lgf)       # -log2(U), 12.20 fixed point
    return (((MEAN * 45426) >> 16) * neg >> 20) + 1


random.seed(2)
n = 4_000_000
v = [draw(random.getrandbits(32)) for _ in range(n)]
print(f"mean {sum(v) / n:.1f} vs {MEAN} ({100 * (sum(v) / n / MEAN - 1):+.3f}%, sd of this check {100 / math.sqrt(n):.3f}%)")
for s in (16, 64, 256, 4096):
    emp = sum(1 for t in v if t <= s) / n
    print(f"P(draw <= {s}) = {emp:.6f} vs {1 - math.exp(-s / MEAN):.6f}")
