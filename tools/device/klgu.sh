#!/usr/bin/env bash
# Session 13, issue 9 (branch s13-klgu): path 29 (path 12's BF16 expert GEMMs taking their items from a
# counter, LUNAR_MOE_PREFILL=wsdyn) against path 12 on Kimi-Linear-48B's 8K prefill, in one call:
#  1. the op tests (cuda_moe_experts_bf16 runs path 29 on every BF16 wgmma case; cuda_moe_layer and
#     cuda_forward with the defaults, then with wsdyn: path 29 through the layer and the forward, graphs == eager)
#  2. LUNAR_MOE_BENCH=prefill-bf16 cuda_moe_bench (both GEMMs, 8192 tokens: 12, 29, 12, 29 among the others)
#  3. Nsight Compute of the two expert kernels in one 8K prefill, default then wsdyn (time, DRAM read / written)
#  4. ROUNDS alternating rounds of the 8K prefill, default vs wsdyn (no round started after AB_S seconds)
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=4] [AB_S=150] [NCU=1] tools/device/klgu.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
tst() {  # name [env]
  step "lunar_tests $1 ${2:-}"
  env ${2:-LUNAR_NONE=0} LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests $1 > $OUT/t_$1${2:+_dyn}.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, ' $OUT/t_$1${2:+_dyn}.log | cut -c1-200 | tail -4 >> $T
}
tst cuda_moe_experts_bf16
# path 29's cases: the largest error against the CPU op and against the first path of each case
grep -E 'wsdyn' $OUT/t_cuda_moe_experts_bf16.log | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9.]+e[-+][0-9]+$/) {v = $i + 0; if (/ vs /) {if (v > mv) mv = v} else if (v > mc) mc = v}} END {printf "path 29: %d lines, max rel err vs CPU %.3g, vs the case'"'"'s first path %.3g\n", NR, mc, mv}' >> $T
grep -E 'wsdyn' $OUT/t_cuda_moe_experts_bf16.log | head -3 | cut -c1-160 >> $T
tst cuda_moe_layer
tst cuda_moe_layer LUNAR_MOE_PREFILL=wsdyn
tst cuda_forward
tst cuda_forward LUNAR_MOE_PREFILL=wsdyn
step "cuda_moe_bench prefill-bf16"
LUNAR_MOE_BENCH=prefill-bf16 timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured here' $OUT/bench.log | grep -vE 'mma.sync|wgmma \(4\)|pfence|cluster \(7\)' | cut -c1-150 >> $T
if [ "${NCU:-1}" = 1 ]; then
  for v in LUNAR_NONE=0 LUNAR_MOE_PREFILL=wsdyn; do
    step "ncu moe_ws_kernel [$v]"
    env $v timeout 70 ncu --replay-mode application --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv -k regex:moe_ws_kernel \
      --launch-count 104 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu_$v.csv 2> $OUT/ncu_$v.err
    echo "ncu rc=$?" >> $T
    python3 - $OUT/ncu_$v.csv >> $T <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    k.setdefault(int(r[ii]), {"name": r[ki].split("(")[0].replace("void ", "")})[r[mi]] = float(r[vi].replace(",", ""))
by = collections.defaultdict(list)
for d in k.values(): by[d["name"]].append(d)
for n, ds in by.items():  # the 8K prefill's launches: the larger half (the bench's first forward is shorter)
    ds = sorted(ds, key=lambda d: -d.get("gpu__time_duration.sum", 0))[:max(1, len(ds) // 2)]
    t = sum(d.get("gpu__time_duration.sum", 0) for d in ds) / len(ds) / 1e3
    rd = sum(d.get("dram__bytes_read.sum", 0) for d in ds) / len(ds) / 1e6
    wr = sum(d.get("dram__bytes_write.sum", 0) for d in ds) / len(ds) / 1e6
    print("%-40s %3d launches (top %d): %.1f us, read %.1f MB, write %.1f MB" % (n[:40], len(by[n]), len(ds), t, rd, wr))
PY
  done
fi
for r in $(seq 1 "${ROUNDS:-4}"); do
  i=0
  for v in LUNAR_NONE=0 LUNAR_MOE_PREFILL=wsdyn; do
    i=$((i + 1))
    env $v timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/pf_${i}_$r.log 2>&1
    echo "rc=$? round $r [$v]: $(awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6, $7}' $OUT/pf_${i}_$r.log | tr '\n' ' ')" >> $T
  done
  [ $(( $(date +%s) - t0 )) -gt ${AB_S:-150} ] && break
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=summary.txt -- * && rm -rf t_* pf_* ncu_*.err)
cat $T
