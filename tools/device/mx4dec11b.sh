#!/usr/bin/env bash
# Issue 8, session 11, call 2 (branch s11-mx4dec): LB = LUNAR_MOE_LATENT_BF16=1 (the latent
# projection stores bf16 at one token: one launch fewer, the gate/up kernel right behind the
# projection, the route two launches back), LBE = LB + LUNAR_MOE_F16_EARLY=15 (the gate/up kernel's
# first fill before its PDL wait, now beside the projection's tail), LBEW = LBE + LUNAR_MOE_F16_WAVES=2,
# against the default (u). The K3 forward test under LBEW first, then the K3.1 TP8 slice at B = 1
# (rounds alternating while time is left).
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec11b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec11b.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
setv() {  # u / LB / LBE / LBEW
  unset LUNAR_MOE_F16_WAVES LUNAR_MOE_F16_EARLY LUNAR_MOE_LATENT_BF16
  case $1 in
    LB) export LUNAR_MOE_LATENT_BF16=1;;
    LBE) export LUNAR_MOE_LATENT_BF16=1 LUNAR_MOE_F16_EARLY=15;;
    LBEW) export LUNAR_MOE_LATENT_BF16=1 LUNAR_MOE_F16_EARLY=15 LUNAR_MOE_F16_WAVES=2;;
  esac
}
step "cuda_forward_k3 (LBEW)"
setv LBEW
OMP_NUM_THREADS=16 timeout 15 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2 3; do for x in u LB LBE LBEW; do
  left 52 || break
  step "K3.1 slice $x round $r"
  setv $x
  timeout 12 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
setv u
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec11b.txt -- * && rm -f t_* k3_*)
cat $T
