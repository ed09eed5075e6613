#!/usr/bin/env bash
# Session 14, issue 9 (branch s14-shx): the shared expert as routed row E of the BF16 grouped GEMM in prefills,
# run at f6775ca, where unset meant the row (LUNAR_MOE_SHROW=0 the side stream, =all the row at every n > 1);
# since the next commits unset is the side stream and =1 the row (the "def" runs below need =1 there):
#  1. lunar_tests cuda_forward (the new shared_row_vs_side_stream, kernel shapes vs CPU with =0 / =all runs,
#     goldens, graphs == eager), cuda_moe_layer, cuda_moe_permute
#  2. Kimi-Linear-48B: round 1 = 8K prefill (profiled) + decode B = 8 / 64 at 1K for =0, default, =all;
#     further rounds 8K prefill only, =0 vs default, alternating, none started after AB_S seconds
#   P=<prebuilt dir> OUT=<dir> [AB_S=185] tools/device/shx.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
tst() {  # filter seconds
  step "lunar_tests $1"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout $2 $P/bin/lunar_tests $1 > $OUT/t_$1.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |shared row|side stream|every n' $OUT/t_$1.log | cut -c1-260 | tail -12 >> $T
}
tst cuda_forward 80
tst cuda_moe_layer 25
tst cuda_moe_permute 20
pre() { awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6, $7}' "$1" | tr '\n' ' '; }
dec() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; }
step "round 1: prefill 8K (profiled) + decode B 8/64"
for v in 0 def all; do
  e=LUNAR_NONE=0; [ $v != def ] && e=LUNAR_MOE_SHROW=$v
  env $e timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
    --batch-sizes 8,64 --contexts 1024 --steps 16 --profile > $OUT/r1_$v.log 2>&1
  echo "rc=$? [$v] $(pre $OUT/r1_$v.log) | $(dec $OUT/r1_$v.log)" >> $T
  grep -A24 '^profile of one prefill' $OUT/r1_$v.log | grep -E 'moe|shared|router|expert|sum' | tr -s ' ' | tr '\n' ';' | cut -c1-400 >> $T
  echo >> $T
done
for r in 2 3 4 5 6 7 8; do
  for v in 0 def; do
    [ $(( $(date +%s) - t0 )) -gt ${AB_S:-185} ] && break 2
    e=LUNAR_NONE=0; [ $v != def ] && e=LUNAR_MOE_SHROW=$v
    env $e timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
      --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/pf_${v}_$r.log 2>&1
    echo "rc=$? round $r [$v]: $(pre $OUT/pf_${v}_$r.log)" >> $T
  done
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -rf t_* pf_* r1_*)
cat $T
