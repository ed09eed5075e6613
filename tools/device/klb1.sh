#!/usr/bin/env bash
# Session 11, task s11-klb1 (issue 9: Kimi-Linear-48B decode at batch 1 towards 2.0 ms): fewer launches. One call,
# each step only while time is left:
#   op tests (lunar_cuda_matmul_glu: the GLU inside the down gemv; lunar_cuda_matmul_add_rmsnorm: o_proj with the
#   residual add + RMSNorm in its last block; both memcmp-equal to the pairs they replace and within the CPU op's
#   tolerance), the kernels they share code with, the forward with both merges on (graphs == eager, goldens, the
#   merged step's logits bit-equal to the unmerged one's), then alternating rounds of Kimi-Linear B = 1 (1K
#   context, 64 steps): default / LUNAR_SHARED_GLU=1 / LUNAR_OPROJ_NORM=1 / both / both + LUNAR_COMBINE_NORM=1,
#   then Nsight Compute (application replay, each kernel alone; only the kernels the merges touch, the whole
#   step's ran past 40 s in session 10) of the last B = 1 decode step, default and both merges: kernel, launches, us.
#   P=.xfer-NAME OUT=/tmp/o [ROUNDS=3] [AB="..."] [NCU_AB="..."] [NCU=0] [TESTS=none] [BUDGET=130] tools/device/klb1.sh
# (call 2 of the session: TESTS=none NCU=0 ROUNDS=4 AB="$BOTH LUNAR_CUDA_PDL=0 LUNAR_CUDA_PDL=0,$BOTH", the merges
# with and without PDL)
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=klb1.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
B=${BUDGET:-130}
K=configs/kimi-linear-48b-a3b.json
BOTH=LUNAR_SHARED_GLU=1,LUNAR_OPROJ_NORM=1
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
timeout 20 nvidia-smi -q -d POWER,CLOCK > $OUT/power.txt 2>&1
grep -E 'Power Limit|^ +SM +:' $OUT/power.txt | head -3 >> $T
for f in ${TESTS:-cuda_matmul_glu cuda_matmul_add_rmsnorm cuda_add_rmsnorm cuda_glu cuda_matmul_bf16 cuda_forward $BOTH:cuda_forward}; do
  v=LUNAR_NONE=0; case $f in *:*) v=${f%%:*}; f=${f#*:};; esac
  left $((B - 60)) || break
  step "lunar_tests $f $v"
  env ${v//,/ } OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/t_${f}_${v%%=*}.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|differs|folds' $OUT/t_${f}_${v%%=*}.log | cut -c1-200 | tail -6 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-LUNAR_SHARED_GLU=1 LUNAR_OPROJ_NORM=1 $BOTH $BOTH,LUNAR_COMBINE_NORM=1}; do
    i=$((i + 1))
    left $((B - 30)) || break 2
    step "KL48 decode B=1 $v round $r"
    env ${v//,/ } timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
# the last forward's launches (the decode step after the 16-token prefill), grouped by kernel
cat > /tmp/kl.py <<'PY'
import csv, gzip, collections, sys
rows = [r for r in csv.reader(gzip.open(sys.argv[1], "rt")) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    k.setdefault(int(r[ii]), {"name": r[ki]})[r[mi]] = float(r[vi].replace(',', ''))
ids = sorted(k); emb = [i for i in ids if k[i]["name"].startswith("void embedding_kernel")]
s, e = emb[-1], ids[-1] + 1
g = collections.OrderedDict()
for i in ids:
    if not (s <= i < e): continue
    d = k[i]; n = d["name"].split("(")[0].replace("void ", "")
    a = g.setdefault(n, [0, 0.0, 0.0]); a[0] += 1; a[1] += d.get("gpu__time_duration.sum", 0) / 1e3; a[2] += d.get("dram__bytes_read.sum", 0) / 1e6
print("| kernel | launches | us | us / launch | MB | GB/s |"); print("|---|---|---|---|---|---|")
for n, (c, t, b) in sorted(g.items(), key=lambda x: -x[1][1]):
    print("| `%s` | %d | %.1f | %.2f | %.0f | %.0f |" % (n[:56], c, t, t / c, b, b / t * 1e3 if t else 0))
print("sum %d launches %.1f us" % (sum(a[0] for a in g.values()), sum(a[1] for a in g.values())))
PY
for v in LUNAR_NONE=0 ${NCU_AB:-$BOTH}; do
  [ "${NCU:-1}" = 1 ] || break
  left $((B - 15)) || break
  step "ncu: one KL48 B=1 decode step, the touched kernels, $v"
  env ${v//,/ } timeout 45 ncu --replay-mode application --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv -k regex:'gemv|norm_vec|glu|combine|embedding' \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 1024 --steps 1 \
    > $OUT/ncu_${v%%=*}.csv 2> $OUT/ncu.err
  echo "ncu rc=$?" >> $T; gzip -f $OUT/ncu_${v%%=*}.csv
  python3 /tmp/kl.py $OUT/ncu_${v%%=*}.csv.gz >> $T 2>&1
done
step done
(cd "$OUT" && tar czf logs.tgz ab_*.log t_*.log ncu.err 2> /dev/null; rm -f ab_*.log t_*.log ncu.err)
cat $T
