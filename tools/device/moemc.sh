#!/usr/bin/env bash
# Session 9, issues 8/9 (branch s9-moemc): MoE prefill path 17 (LUNAR_MOE_PREFILL=wsmc: path 12's BF16
# kernel in clusters of 2 CTAs, an expert's M tile pairs sharing each weight chunk by TMA multicast,
# the odd last tiles paired without) in one device call: the BF16 experts op tests (every path vs the
# CPU op, 17 among them), the prefill kernel table (LUNAR_MOE_BENCH=prefill-bf16: paths 12 / 7 / 17 /
# 12 / 17 on Kimi-Linear's shape), then the Kimi-Linear 8K prefill, default (path 12) vs wsmc in
# alternating rounds with --profile, and (time left) the forward tests under wsmc.
#   P=<prebuilt dir> OUT=<dir> [AB_S=s: no round started after s seconds] tools/device/moemc.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moemc.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
K=configs/kimi-linear-48b-a3b.json
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_bf16 (path 17 = wsmc among the others, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 50 $P/bin/lunar_tests cuda_moe_experts_bf16 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsmc |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-160 | tail -40 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill kernel table (LUNAR_MOE_BENCH=prefill-bf16)"
LUNAR_MOE_BENCH=prefill-bf16 timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-150 >> $T
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(experts|moe|kda_core|attn)$/ {printf "%s %s; ", $1, $2}' "$1"; }
bench() { # name, env
  env $2 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
    --batch-sizes 1 --contexts 1024 --steps 1 --profile > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
for r in 1 2 3; do
  late ${AB_S:-100} && break
  step "Kimi-Linear 8K prefill A/B round $r"
  if [ $r = 2 ]; then bench wsmc_$r LUNAR_MOE_PREFILL=wsmc; bench def_$r LUNAR_NONE=0
  else bench def_$r LUNAR_NONE=0; bench wsmc_$r LUNAR_MOE_PREFILL=wsmc; fi
done
! late ${FWD_S:-150} && { step "LUNAR_MOE_PREFILL=wsmc lunar_tests cuda_forward"
  LUNAR_MOE_PREFILL=wsmc OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -6 >> $T; }
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moemc.txt -- * && rm -f b_*.log t_fwd.log)  # 8 files come back
cat $T
