#!/usr/bin/env bash
# Session 13, s13-klgu's second call: path 29 as BF16's prefill default. The op tests on the default
# (cuda_moe_layer and cuda_forward now run path 29), then ROUNDS alternating rounds of Kimi-Linear-48B's
# 8K prefill: the default (29), LUNAR_MOE_PREFILL=wsfast (path 12, the old default) and
# LUNAR_MOE_YBUF=bf16 (29 writing the down GEMM's rows in bf16, the combine reading bf16: a numerics
# choice), no round started after AB_S seconds.
# NCU=1: Nsight Compute of the expert kernels and the combine in one 8K prefill, the default vs bf16 rows.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] [AB_S=45] [NCU=1] tools/device/klgu2.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
for t in cuda_moe_experts_bf16 cuda_moe_layer cuda_forward; do
  step "lunar_tests $t"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests $t > $OUT/t_$t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, ' $OUT/t_$t.log | cut -c1-200 | tail -4 >> $T
done
grep -E 'wide, fused MoE  ' $OUT/t_cuda_forward.log | cut -c1-200 >> $T
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 LUNAR_MOE_PREFILL=wsfast LUNAR_MOE_YBUF=bf16; do
    i=$((i + 1))
    env $v timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/pf_${i}_$r.log 2>&1
    echo "rc=$? round $r [$v]: $(awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6, $7}' $OUT/pf_${i}_$r.log | tr '\n' ' ')" >> $T
  done
  [ $(( $(date +%s) - t0 )) -gt ${AB_S:-45} ] && break
done
if [ "${NCU:-1}" = 1 ]; then  # the expert kernels and the combine, fp32 rows (default) vs bf16 rows
  for v in LUNAR_NONE=0 LUNAR_MOE_YBUF=bf16; do
    step "ncu [$v]"
    env $v timeout 60 ncu --replay-mode application --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv -k regex:'moe_ws_kernel|moe_combine' \
      --launch-count 160 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu.csv 2> $OUT/ncu.err
    echo "ncu rc=$?" >> $T
    python3 - $OUT/ncu.csv >> $T <<'PY'
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
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=summary.txt -- * && rm -rf t_* pf_*)
cat $T
