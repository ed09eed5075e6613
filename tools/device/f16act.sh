#!/usr/bin/env bash
# Issue 8, session 8 wave 2 (branch s8-f16act): MXFP4 decode path 16 with LUNAR_MOE_F16_XS (each
# pass's activation rows converted to f16 once into shared memory; 1 = where 4 blocks per SM stay,
# K3.1 batch 1; 2 = wherever it fits; unset / 0 = today's per-chunk conversion, the default).
# In order of priority, each step only while time is left (about 100 s in all): the expert op tests under
# =1 (path 16 under =0 / =1 / =2 bit-equal, and vs the CPU), the decode bench at batch 1 (K3.1's
# MXFP4 shapes) =0 vs =1 in two alternating rounds, the K3.1 TP8 slice decode =0 vs =1, then the K3
# forward test under =2 (every path-16 pass through shared memory).
#   P=.xfer-NAME OUT=/tmp/o tools/device/f16act.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=f16act.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
step "op tests: cuda_moe_experts_mxfp4 (the path-16 cases), LUNAR_MOE_F16_XS=1"
LUNAR_MOE_F16_XS=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|XS=' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
for r in 1 2; do for x in 0 1; do
  left 80 || break
  step "decode1 bench LUNAR_MOE_F16_XS=$x round $r"
  LUNAR_MOE_F16_XS=$x LUNAR_MOE_BENCH=decode1 timeout 10 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| [KM]|Measured' $OUT/bench_${x}_$r.log >> $T
done; done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for x in 0 1; do
  left 100 || break
  step "K3.1 slice LUNAR_MOE_F16_XS=$x"
  LUNAR_MOE_F16_XS=$x timeout 14 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_$x.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_$x.log)" >> $T
done
if left 110; then
  step "cuda_forward_k3 LUNAR_MOE_F16_XS=2"
  LUNAR_MOE_F16_XS=2 OMP_NUM_THREADS=16 timeout 8 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -6 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=f16act.txt -- * && rm -f t_* k3_* bench_*)
cat $T
