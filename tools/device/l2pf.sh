#!/usr/bin/env bash
# Session 15 (issue 9): the decode step's L2 prefetch on a stream of its own (LUNAR_L2PF bits, model/forward_cuda.c
# l2pf_fork, cuda_l2pf.cu) in one device call:
#  0. LUNAR_L2PF_BENCH=1 lunar_tests cuda_l2_prefetch_bench: each request kind alone, and a gemv cold vs after it
#  1. op tests: lunar_tests cuda_l2_prefetch (the kernel changes nothing, faults nowhere) and
#     cuda_forward_l2pf (logits bit-equal with every bit on, wide and K3 models, graphs), then cuda_forward (defaults)
#  2. Kimi-Linear-48B B = 1, 1K, 64 steps: the default then each AB variant, ROUNDS rounds alternating
#  3. B8 (LUNAR_L2PF_ROWS=8) and the K3.1 TP8 slice B = 1 (10 layers, 8K context), default vs K3AB, alternating
#  4. ONCE: tuning variants timed once each (chunk size, grid)
# Each section runs while under BUDGET s from the start.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] [AB="LUNAR_L2PF=1 ..."] [B8AB=...] [K3AB=...] [ONCE=...] [BUDGET=200] \
#     bash tools/device/l2pf.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=l2pf.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
left() { [ $(( $(date +%s) - t0 )) -lt "${BUDGET:-200}" ]; }
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
step "L2 prefetch bench (LUNAR_L2PF_BENCH=1 lunar_tests cuda_l2_prefetch_bench)"
LUNAR_L2PF_BENCH=1 timeout 60 $P/bin/lunar_tests cuda_l2_prefetch_bench > $OUT/t_bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^  ' $OUT/t_bench.log >> $T
for f in ${TESTS:-cuda_l2_prefetch cuda_forward}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|differ|forks' $OUT/t_$f.log | cut -c1-200 | tail -8 >> $T
done
kl() { # variant, batch, tag
  env ${1//,/ } timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
    --batch-sizes $2 --contexts 1024 --steps 64 > $OUT/ab_$3.log 2>&1
  echo "rc=$? $(tpot $OUT/ab_$3.log)" >> $T
}
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-LUNAR_L2PF=1 LUNAR_L2PF=5 LUNAR_L2PF=7 LUNAR_L2PF=15}; do
    i=$((i + 1)); left || break
    step "KL48 B=1 $v round $r"; kl "$v" 1 "${i}_$r"
  done
done
for r in 1 2; do
  i=0
  for v in LUNAR_NONE=0 ${B8AB:-LUNAR_L2PF=7,LUNAR_L2PF_ROWS=8}; do
    i=$((i + 1)); left || break
    step "KL48 B=8 $v round $r"; kl "$v" 8 "b8_${i}_$r"
  done
done
for r in 1 2; do
  i=0
  for v in LUNAR_NONE=0 ${K3AB:-LUNAR_L2PF=7 LUNAR_L2PF=15}; do
    i=$((i + 1)); left || break
    step "K3.1 TP8 slice B=1 $v round $r"
    env ${v//,/ } timeout 90 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 16 \
      --batch-sizes 1 --contexts 8192 --steps 64 > $OUT/ab_k3_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_k3_${i}_$r.log)" >> $T
  done
done
for v in ${ONCE:-}; do
  left || break
  step "KL48 B=1 $v once"; kl "$v" 1 "once_${v//[^A-Za-z0-9]/_}"
done
step done
(cd "$OUT" && tar czf ab.tgz ab_*.log t_*.log && rm -f ab_*.log t_*.log)
cat $T
