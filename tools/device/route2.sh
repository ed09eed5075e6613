#!/usr/bin/env bash
# Session 7, issue 9: the batch-1 route inside the MoE gate/up decode kernel (LUNAR_MOE_ROUTE_FUSED).
# One device call (~100 s warm): the MoE op tests (cuda_moe_route_fused_matches_route_one among them),
# the forward tests with the switch on (goldens, graphs == eager bitwise), then an A/B (LUNAR_MOE_ROUTE_FUSED=1
# vs the default route-one launch) of Kimi-Linear-48B B=1 and the K3.1 TP8 slice B=1, two rounds alternating.
#   tools/device/route2.sh DIR     (DIR: the prebuilt folder; summary in $OUT/summary.txt)
set -u
P=${1:?usage: route2.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-route2}
. tools/device/env.sh
nvidia-smi -L >> $T
for f in cuda_moe_ cuda_forward; do
  step "lunar_tests $f (LUNAR_MOE_ROUTE_FUSED=1)"
  LUNAR_MOE_ROUTE_FUSED=1 OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|FAIL|passed, |bitwise|skipped|differs' $OUT/t_$f.log | cut -c1-300 | tail -14 >> $T
done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
kl() { timeout 90 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 \
  --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/kl_$1.txt 2>&1; echo "rc=$?" >> $T; tpot $OUT/kl_$1.txt >> $T; }
k3() { timeout 90 $P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --backend cuda --tp-slice 8 --num-layers 10 \
  --project-layers 93 --input-lens 1024 --batch-sizes 1 --contexts 8192 > $OUT/k3_$1.txt 2>&1; echo "rc=$?" >> $T; tpot $OUT/k3_$1.txt >> $T; grep -i 'project' $OUT/k3_$1.txt | head -2 >> $T; }
for round in 1 2; do
  step "KL48 B=1 fused r$round"; LUNAR_MOE_ROUTE_FUSED=1 kl f$round
  step "KL48 B=1 separate r$round"; kl s$round
  step "K3.1 slice B=1 fused r$round"; LUNAR_MOE_ROUTE_FUSED=1 k3 f$round
  step "K3.1 slice B=1 separate r$round"; k3 s$round
done
step done
cd $OUT && tar czf logs.tgz *.txt *.log 2>/dev/null; rm -f kl_*.txt k3_*.txt t_*.log
