# Sums an ncu --csv file (gpu__time_duration.sum) per kernel name: count, mean, the last 7 launches (one
# decode step of the 7 MLA layers of Kimi-Linear), min, max. Used by mla_fp8_r4.sh.
import csv, gzip, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
agg = collections.OrderedDict()
for r in rows:
    if hdr is None:
        if 'Kernel Name' in r: hdr = r
        continue
    if len(r) != len(hdr): continue
    d = dict(zip(hdr, r))
    if d.get('Metric Name') != 'gpu__time_duration.sum': continue
    n = d['Kernel Name'][:90]
    v = float(d['Metric Value'].replace(',', ''))
    u = d.get('Metric Unit', '')
    us = v / 1000.0 if u in ('nsecond', 'ns') else v if u in ('usecond', 'us') else v * 1000 if u in ('msecond', 'ms') else v
    a = agg.setdefault(n, [])
    a.append(us)
for n, a in agg.items():
    print(f"{n}: n={len(a)} mean={sum(a)/len(a):.1f} us last7={sum(a[-7:]):.1f} us min={min(a):.1f} max={max(a):.1f}")
