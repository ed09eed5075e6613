#!/usr/bin/env python3
# The per-kernel table of one decode step from an Nsight Compute CSV (gpu__time_duration.sum, dram__bytes_read.sum;
# see docs/benchmarks.md "Session 6, call 3"): tools/device/ncu_step.py FILE.csv[.gz] STEP, STEP indexing the
# embedding launches that start each forward (-3 = the third from last), or "max": the forward with the largest
# kernel time (an 8K prefill's table from a lunar bench run that also decodes).
import csv, gzip, collections, sys
rows = [r for r in csv.reader((gzip.open(sys.argv[1], "rt") if sys.argv[1].endswith(".gz") else open(sys.argv[1]))) if len(r) > 10]
h = rows[0]
ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    d = k.setdefault(int(r[ii]), {"name": r[ki]})
    d[r[mi]] = float(r[vi].replace(',', ''))
ids = sorted(k)
emb = [i for i in ids if k[i]["name"].startswith("void embedding_kernel")] + [ids[-1] + 1]
if sys.argv[2] == "max":  # the forward with the largest kernel time (a prefill among decode steps)
    seg = [sum(k[i].get("gpu__time_duration.sum", 0) for i in ids if a <= i < b) for a, b in zip(emb, emb[1:])]
    print("forwards", len(seg), "kernel ms each", " ".join("%.1f" % (x / 1e6) for x in seg))
    j = max(range(len(seg)), key=lambda x: seg[x])
else:
    j = int(sys.argv[2]) if int(sys.argv[2]) >= 0 else len(emb) - 1 + int(sys.argv[2])
s = emb[j]; e = emb[j + 1]
step = [i for i in ids if s <= i < e]
print("step kernels", len(step), "ids", s, e - 1)
# dram__bytes_write.sum where the CSV has it (the prefill tables): a column of MB written, GB/s of both
wr = any("dram__bytes_write.sum" in d for d in k.values())
agg = collections.OrderedDict(); tt = tb = tw = 0
for i in step:
    d = k[i]; n = d["name"].split("(")[0].replace("void ", "")
    t = d.get("gpu__time_duration.sum", 0) / 1e3; b = d.get("dram__bytes_read.sum", 0) / 1e6
    w = d.get("dram__bytes_write.sum", 0) / 1e6
    a = agg.setdefault(n, [0, 0, 0, 0]); a[0] += 1; a[1] += t; a[2] += b; a[3] += w; tt += t; tb += b; tw += w
print("sum of kernel times %.1f us, DRAM read %.1f MB, read floor at 4.2 TB/s %.1f us" % (tt, tb, tb / 4.2e6 * 1e6)
      + (", written %.1f MB, read + written floor %.1f us" % (tw, (tb + tw) / 4.2e6 * 1e6) if wr else ""))
print("| kernel | launches | us | MB read |" + (" MB written |" if wr else "") + " GB/s | us / launch |")
print("|---|---|---|---|" + ("---|" if wr else "") + "---|---|")
for n, (c, t, b, w) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print("| `%s` | %d | %.1f | %.1f |" % (n[:60], c, t, b) + (" %.1f |" % w if wr else "")
          + " %.0f | %.2f |" % ((b + w) / t * 1e3 if t else 0, t / c))
