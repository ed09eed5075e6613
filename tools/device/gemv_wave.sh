#!/usr/bin/env bash
# Session 10, task s10-gemv (issue 9: Kimi-Linear-48B decode at batch 1): the one-wave gemv (LUNAR_GEMV_WAVE=1,
# =2 with the next row's L2 prefetch) against the default grids. One call, each step only while time is left:
#   op tests (the wave kernel bit-equal to the default and within the CPU op's tolerance; the forward with it,
#   graphs == eager), alternating rounds of Kimi-Linear B = 1 (1K context, 64 steps) default / WAVE=1 / 2 / 3,
#   then Nsight Compute (application replay, each kernel alone, only the gemv and embedding kernels: the whole
#   step's kernels under ncu ran past 40 s) of the last B = 1 decode step, default and WAVE=1: the gemv launches
#   grouped by kernel, grid and MB.
#   P=.xfer-NAME OUT=/tmp/o [ROUNDS=3] [AB="LUNAR_GEMV_WAVE=1 LUNAR_GEMV_WAVE=2 LUNAR_GEMV_WAVE=3"] [BUDGET=150] tools/device/gemv_wave.sh
# The kernel and its switch were measured slower in the step and left the tree: this needs the binaries of
# commit db9ab77 (docs/benchmarks.md, "Decode B = 1: one-wave gemv (session 10, H200)").
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=gemv_wave.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
B=${BUDGET:-150}
K=configs/kimi-linear-48b-a3b.json
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
for f in ${TESTS:-cuda_matmul_gemv_wave cuda_matmul_bf16 LUNAR_GEMV_WAVE=1:cuda_forward}; do
  v=LUNAR_NONE=0; case $f in *:*) v=${f%%:*}; f=${f#*:};; esac
  step "lunar_tests $f $v"
  env ${v//,/ } OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|rel err|differs' $OUT/t.log | cut -c1-200 | tail -6 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-LUNAR_GEMV_WAVE=1 LUNAR_GEMV_WAVE=2 LUNAR_GEMV_WAVE=3}; do
    i=$((i + 1))
    left $((B - 45)) || break 2
    step "KL48 decode B=1 $v round $r"
    env ${v//,/ } timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
# per launch: kernel, grid, MB, us (the gemv launches of one step grouped)
cat > /tmp/gv.py <<'PY'
import csv, gzip, collections, sys
rows = [r for r in csv.reader(gzip.open(sys.argv[1], "rt")) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    k.setdefault(int(r[ii]), {"name": r[ki]})[r[mi]] = float(r[vi].replace(',', ''))
ids = sorted(k); emb = [i for i in ids if k[i]["name"].startswith("void embedding_kernel")]
s, e = emb[-1], ids[-1] + 1  # the last forward: the decode step after the 16-token prefill
g = collections.OrderedDict()
for i in ids:
    if not (s <= i < e) or "gemv" not in k[i]["name"]: continue
    d = k[i]; n = d["name"].split("(")[0].replace("void ", "")
    key = (n, int(d.get("launch__grid_size", 0)), round(d.get("dram__bytes_read.sum", 0) / 1e6))
    a = g.setdefault(key, [0, 0.0, 0.0]); a[0] += 1; a[1] += d.get("gpu__time_duration.sum", 0) / 1e3; a[2] += d.get("dram__bytes_read.sum", 0) / 1e6
print("| kernel | grid | MB | launches | us / launch | GB/s |"); print("|---|---|---|---|---|---|")
for (n, gr, mb), (c, t, b) in sorted(g.items(), key=lambda x: -x[1][1]):
    print("| `%s` | %d | %d | %d | %.2f | %.0f |" % (n[:48], gr, mb, c, t / c, b / t * 1e3))
print("gemv sum %.1f us" % sum(a[1] for a in g.values()))
PY
for v in LUNAR_NONE=0 ${NCU_AB:-LUNAR_GEMV_WAVE=1}; do
  left $((B - 20)) || break
  step "ncu: one KL48 B=1 decode step, per kernel, $v"
  env ${v//,/ } timeout 50 ncu --replay-mode application --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --csv -k regex:'gemv|embedding' \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 1024 --steps 1 \
    > $OUT/ncu_${v%%=*}.csv 2> $OUT/ncu.err
  echo "ncu rc=$?" >> $T; gzip -f $OUT/ncu_${v%%=*}.csv
  python3 /tmp/gv.py $OUT/ncu_${v%%=*}.csv.gz >> $T 2>&1
done
step done
(cd "$OUT" && tar czf logs.tgz ab_*.log ncu.err 2> /dev/null; rm -f ab_*.log t.log ncu.err)
cat $T
