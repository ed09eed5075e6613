#!/usr/bin/env bash
# Issue 8, session 9 (branch s9-mx4dec3): path 16 (MXFP4 decode on f16 tensor cores) with several row
# groups per block, each warp's copy ring running on across them (LUNAR_MOE_F16_TILES: 0 / unset =
# off, 1 = about one wave of blocks, N = N groups a block). In order, each step only while time is
# left (about 180 s in all): the expert op tests (path 16 under TILES = 2 / 3 / 1 bit-equal to 0 with
# XS = 0 and 2, and vs the CPU), the decode bench at batch 1 (K3.1's MXFP4 shapes) TILES = 0 / 1 / 2 / 3
# in two alternating rounds, the K3 forward test under TILES = 2, the K3.1 TP8 slice decode B = 1
# TILES = 0 vs 1 in two alternating rounds, Kimi-Linear B = 1 (its BF16 experts do not run path 16).
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec3.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec3.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
step "op tests: cuda_moe_experts_mxfp4 (path 16 incl. LUNAR_MOE_F16_TILES cases)"
OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|TILES' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
for r in 1 2; do for x in 0 1 2 3; do
  left 100 || break
  step "decode1 bench LUNAR_MOE_F16_TILES=$x round $r"
  LUNAR_MOE_F16_TILES=$x LUNAR_MOE_BENCH=decode1 timeout 15 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/bench_${x}_$r.log >> $T
done; done
if left 110; then
  step "cuda_forward_k3 LUNAR_MOE_F16_TILES=2"
  LUNAR_MOE_F16_TILES=2 OMP_NUM_THREADS=16 timeout 12 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -6 >> $T
fi
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2; do for x in 0 1; do
  left 150 || break
  step "K3.1 slice B=1 LUNAR_MOE_F16_TILES=$x round $r"
  LUNAR_MOE_F16_TILES=$x timeout 14 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
if left 140; then
  step "Kimi-Linear B=1 (BF16 experts: not path 16)"
  timeout 40 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
    --input-lens 1024 --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/kl.log 2>&1
  echo "rc=$? $(tpot $OUT/kl.log)" >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec3.txt -- * && rm -f t_* k3_* bench_* kl.log)
cat $T
