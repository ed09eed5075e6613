#!/usr/bin/env bash
# Issue 8, session 11 (branch s11-mx4dec), one call: path 16 at one token, three switches against
# the default (unset): W2 = LUNAR_MOE_F16_WAVES=2 (the TILES rule at 2 waves: the TP8 slice's down
# kernel back to one group a block, K3.1 unchanged), E15 = LUNAR_MOE_F16_EARLY=15 (bit 8: the gate/up
# kernel's first fill before its PDL wait where the route is two launches back; the decode bench
# marks it so with LUNAR_MOE_BENCH_SETTLED=1, the forward with the latent), PF = LUNAR_MOE_ROUTE_PF=1024
# (route-one prefetches each chosen expert's gate/up slice into L2, capped at the slice: all of it at
# the TP8 slice, 1 MB of 5.5 at K3.1), ALL = the three. In order, each step only while time is left:
# the op tests (the new sweeps), the K3 forward test with all three on, the decode bench at batch 1
# (two rounds alternating), the K3.1 TP8 slice B = 1, 8 (two rounds alternating).
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec11.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec11.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
setv() {  # u / W2 / E15 / PF / ALL
  unset LUNAR_MOE_F16_WAVES LUNAR_MOE_F16_EARLY LUNAR_MOE_ROUTE_PF LUNAR_MOE_BENCH_SETTLED
  case $1 in
    W2) export LUNAR_MOE_F16_WAVES=2;;
    E15) export LUNAR_MOE_F16_EARLY=15 LUNAR_MOE_BENCH_SETTLED=1;;
    PF) export LUNAR_MOE_ROUTE_PF=1024;;
    ALL) export LUNAR_MOE_F16_WAVES=2 LUNAR_MOE_F16_EARLY=15 LUNAR_MOE_ROUTE_PF=1024 LUNAR_MOE_BENCH_SETTLED=1;;
  esac
}
step "op tests: cuda_moe_experts_mxfp4, cuda_moe_route_one (defaults)"
for t in cuda_moe_experts_mxfp4 cuda_moe_route_one; do
  OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests $t >> $OUT/t_moe.log 2>&1
  echo "$t rc=$?" >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
step "cuda_forward_k3 (ALL: WAVES=2 EARLY=15 ROUTE_PF=1024)"
setv ALL
OMP_NUM_THREADS=16 timeout 20 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
for r in 1 2; do for x in u W2 E15; do
  left 70 || break
  step "decode1 bench $x round $r"
  setv $x
  LUNAR_MOE_BENCH=decode1 timeout 12 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/bench_${x}_$r.log | cut -d'|' -f2,3,6,7,16,17,19 >> $T
done; done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2; do for x in u W2 E15 PF ALL; do
  left 128 || break
  step "K3.1 slice $x round $r"
  setv $x
  timeout 14 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
setv u
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec11.txt -- * && rm -f t_* k3_* bench_*)
cat $T
