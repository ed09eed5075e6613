#!/usr/bin/env python3
"""A Python model of cuda_dsa.cu topk_kernel's selection (session 22's tie path), checked against a sort.

The kernel's radix search over the 64-bit keys (order-preserving score bits << 32 | ~position): 12-bit
digits from the top, each pass a histogram of the keys still matching the prefix and a descending scan
for the bin holding the krem-th key; it stops when that bin holds exactly the keys wanted, or once the
score's 32 bits are fixed (digits 12, 12, 8), the bin's keys then tying on one score. The write takes every
key above (every key >= prefix without a tie) and the krem tied keys of lowest position, in position order.
Rows with many ties, all equal, signed zeros and random scores, against sorting by (score desc, position).

  python3 tools/device/topk_tie_model.py   (prints "ok", or stops at the first row that differs)
"""
import random, struct
def f2u(f): return struct.unpack('<I', struct.pack('<f', f))[0]
def sel_key(s, pos):
    if s == 0.0: s = 0.0
    u = f2u(s)
    u = (~u & 0xffffffff) if (u & 0x80000000) else (u | 0x80000000)
    return (u << 32) | (0xffffffff - pos)
def topk(sc, k):
    n = len(sc)
    if n <= k: return list(range(n))
    keys = [sel_key(s, p) for p, s in enumerate(sc)]
    prefix = mask = 0; krem = k; shift, bits = 52, 12; tie = False
    while True:
        dm = (1 << bits) - 1
        hist = [0] * 4096
        for key in keys:
            if (key & mask) == prefix: hist[(key >> shift) & dm] += 1
        cum = 0
        for b in range(4095, -1, -1):
            if cum + hist[b] >= krem:
                digit, above, cnt = b, cum, hist[b]; break
            cum += hist[b]
        krem -= above
        prefix |= digit << shift; mask |= dm << shift
        tie = cnt != krem
        if not tie or shift == 32: break
        if shift - 12 >= 32: shift -= 12; bits = 12
        else: bits = shift - 32; shift = 32
    th = prefix >> 32
    out = [-1] * k; a = e = 0
    for p, key in enumerate(keys):
        hi = key >> 32
        if (hi > th) if tie else (key >= prefix):
            o = a + min(e, krem)
            if o < k: out[o] = p
            a += 1
        elif tie and hi == th:
            if e < krem and a + e < k: out[a + e] = p
            e += 1
    return out
def ref(sc, k):
    order = sorted(range(len(sc)), key=lambda p: (-(sc[p] if sc[p] != 0 else 0.0), p))
    return sorted(order[:k])
random.seed(1)
for trial in range(300):
    n = random.choice([100, 2049, 3000, 5000, 8192])
    k = random.choice([1, 7, 64, 2048])
    g = trial % 5
    if g == 0: sc = [float(random.randint(0, 2)) for _ in range(n)]
    elif g == 1: sc = [1.5] * n
    elif g == 2: sc = [random.choice([-0.0, 0.0, 1.0, -1.0]) for _ in range(n)]
    elif g == 3: sc = [random.random() for _ in range(n)]
    else: sc = [struct.unpack('<f', struct.pack('<f', 0.75 + random.randint(0, 100000) * 1e-5))[0] for _ in range(n)]
    got = topk(sc, k)
    r = ref(sc, k)
    assert got == r, (trial, g, n, k, got[:10], r[:10])
print("ok: 300 rows equal to the sort")
