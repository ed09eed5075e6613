#!/usr/bin/env python3
# Where one launch's warps stalled, from Nsight Compute's SASS page (--page source --print-source sass --csv) and raw
# page (--page raw --csv) of a report with the SourceCounters section (tools/device/k3lat.sh): the stall reasons by
# share of all PC samples, then the N instructions holding the most samples with their address and text.
#   tools/device/ncu_sass_top.py SASS.csv RAW.csv [N]
import csv, sys
def rows(p):
    try:
        return [r for r in csv.reader(open(p, errors="replace")) if len(r) > 3]
    except OSError:
        return []
n = int(sys.argv[3]) if len(sys.argv) > 3 else 10
raw = rows(sys.argv[2])
if len(raw) >= 2:  # header row, (units row), value row: the pcsamp metrics by stall reason
    h, v = raw[0], raw[-1]
    st = []
    for name, val in zip(h, v):
        if "pcsamp_warps_issue_stalled_" in name and not name.endswith("_not_issued"):
            try:
                st.append((float(val.replace(",", "")), name.split("pcsamp_warps_issue_stalled_")[1]))
            except ValueError:
                pass
    tot = sum(x for x, _ in st) or 1
    print("stall samples %d: " % tot + ", ".join("%s %.0f%%" % (r, 100 * x / tot) for x, r in sorted(st, reverse=True)[:8]))
s = rows(sys.argv[1])
if not s:
    print("no SASS rows"); sys.exit()
h = s[0]
def col(*names):
    for nm in names:
        for i, c in enumerate(h):
            if c.strip() == nm:
                return i
    return None
ai, si = col("# Address", "Address"), col("Source")
wi = col("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)")
ei = col("Instructions Executed")
if wi is None or si is None:
    print("columns:", h[:12]); sys.exit()
body = []
for r in s[1:]:
    try:
        body.append((float(r[wi].replace(",", "") or 0), r))
    except (ValueError, IndexError):
        pass
tot = sum(x for x, _ in body) or 1
print("SASS instructions %d, samples %d" % (len(body), tot))
for x, r in sorted(body, key=lambda t: -t[0])[:n]:
    print("%5.1f%% %s %-60s exec %s" % (100 * x / tot, r[ai] if ai is not None else "?", r[si].strip()[:60],
                                        r[ei] if ei is not None else "?"))
