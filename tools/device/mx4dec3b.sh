#!/usr/bin/env bash
# Issue 8, session 9, call 2 (branch s9-mx4dec3): path 16 with LUNAR_MOE_F16_TILES unset (the rule:
# 2 row groups a block where the one-group grid is >= 1.5 waves) against =0 (off, session 8's kernel).
# In order, each step only while time is left (about 190 s): the MoE op tests under the rule, the
# decode bench at batch 1 (two rounds alternating) and at every batch (one round), the K3.1 TP8 slice
# B = 1, 8, 64 (two rounds alternating), the K3 forward test, Nsight Compute per-kernel times of K3.1's
# gate/up and down at batch 1, Kimi-Linear B = 1 (BF16 experts: not path 16).
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec3b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec3b.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
step "op tests: cuda_moe_ (LUNAR_MOE_F16_TILES unset)"
OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_tests cuda_moe_ > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
for r in 1 2; do for x in 0 u; do
  step "decode1 bench TILES=$x round $r"
  if [ $x = u ]; then unset LUNAR_MOE_F16_TILES; else export LUNAR_MOE_F16_TILES=$x; fi
  LUNAR_MOE_BENCH=decode1 timeout 15 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/bench_${x}_$r.log >> $T
done; done
for x in 0 u; do
  left 120 || break
  step "decode bench (every batch) TILES=$x"
  if [ $x = u ]; then unset LUNAR_MOE_F16_TILES; else export LUNAR_MOE_F16_TILES=$x; fi
  LUNAR_MOE_BENCH=decode timeout 20 $P/bin/lunar_tests cuda_moe_bench > $OUT/bdec_$x.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K|Measured' $OUT/bdec_$x.log | cut -d'|' -f2,3,7,16,17,19 >> $T
done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2; do for x in 0 u; do
  left 165 || break
  step "K3.1 slice TILES=$x round $r"
  if [ $x = u ]; then unset LUNAR_MOE_F16_TILES; else export LUNAR_MOE_F16_TILES=$x; fi
  timeout 16 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
unset LUNAR_MOE_F16_TILES
if left 175; then
  step "cuda_forward_k3 (TILES unset)"
  OMP_NUM_THREADS=16 timeout 12 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
fi
for x in 0 u; do
  left 175 || break
  step "ncu K3.1 batch 1 gate/up + down, TILES=$x"
  if [ $x = u ]; then unset LUNAR_MOE_F16_TILES; else export LUNAR_MOE_F16_TILES=$x; fi
  LUNAR_MOE_BENCH=decode1 timeout 25 ncu --clock-control none -k regex:moe_decode_f16 --launch-count 2 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size $P/bin/lunar_tests cuda_moe_bench \
    > $OUT/ncu_$x.txt 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe_decode_f16_kernel<|gpu__time|dram__bytes|grid_size' $OUT/ncu_$x.txt | sed 's/(anonymous namespace):://' | cut -c1-120 >> $T
done
unset LUNAR_MOE_F16_TILES
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec3b.txt -- * && rm -f t_* k3_* bench_* bdec_* ncu_*)
cat $T
