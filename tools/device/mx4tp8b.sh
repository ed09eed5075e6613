#!/usr/bin/env bash
# Issue 8, session 10, call 2 (branch s10-mx4tp8): LUNAR_MOE_F16_EARLY unset (the new default, 7:
# the down kernel's first ring fill and offsets before griddepcontrol.wait, the route's count and
# expert id together, no offsets / row_token loads at one token) against =0 (session 9's kernels)
# and =3 (call 1's best). In order, each step only while time is left: the MXFP4 op tests and the
# latent MoE layer (default; the EARLY case runs 0 .. 7), the K3 forward test, the decode bench at
# batch 1 (two rounds alternating) and at every batch (one round), the K3.1 TP8 slice B = 1, 8, 64
# (three rounds alternating), Nsight Compute of the TP8 slice's gate/up and down at batch 1.
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4tp8b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4tp8b.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
sete() {  # 0 / 3 / u (unset) / uT0 (unset, LUNAR_MOE_F16_TILES=0)
  unset LUNAR_MOE_F16_EARLY LUNAR_MOE_F16_TILES
  case $1 in u) ;; uT0) export LUNAR_MOE_F16_TILES=0;; *) export LUNAR_MOE_F16_EARLY=$1;; esac
}
step "op tests: cuda_moe_experts_mxfp4, cuda_moe_layer (EARLY unset)"
for t in cuda_moe_experts_mxfp4 cuda_moe_layer; do
  OMP_NUM_THREADS=16 timeout 50 $P/bin/lunar_tests $t >> $OUT/t_moe.log 2>&1
  echo "$t rc=$?" >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
step "cuda_forward_k3 (EARLY unset)"
OMP_NUM_THREADS=16 timeout 15 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
for r in 1 2; do for x in 0 3 u uT0; do
  step "decode1 bench EARLY=$x round $r"
  sete $x
  LUNAR_MOE_BENCH=decode1 timeout 15 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/bench_${x}_$r.log | cut -d'|' -f2,3,6,7,16,17,19 >> $T
done; done
for x in 0 u; do
  left 60 || break
  step "decode bench (every batch) EARLY=$x"
  sete $x
  LUNAR_MOE_BENCH=decode timeout 20 $P/bin/lunar_tests cuda_moe_bench > $OUT/bdec_$x.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K|Measured' $OUT/bdec_$x.log | cut -d'|' -f2,3,7,16,17,19 >> $T
done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2 3; do for x in 0 u; do
  left 125 || break
  step "K3.1 slice EARLY=$x round $r"
  sete $x
  timeout 16 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
for x in 0 u; do
  left 140 || break
  step "ncu TP8 batch 1 gate/up + down (serialised: no PDL overlap), EARLY=$x"
  sete $x
  LUNAR_MOE_BENCH=decode1 timeout 25 ncu --clock-control none -k regex:moe_decode_f16 --launch-skip 46 --launch-count 2 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size $P/bin/lunar_tests cuda_moe_bench \
    > $OUT/ncu_$x.txt 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe_decode_f16_kernel<|gpu__time|dram__bytes|grid_size' $OUT/ncu_$x.txt | sed 's/(anonymous namespace):://' | cut -c1-120 >> $T
done
unset LUNAR_MOE_F16_EARLY LUNAR_MOE_F16_TILES
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4tp8b.txt -- * && rm -f t_* k3_* bench_* bdec_* ncu_*)
cat $T
