#!/usr/bin/env bash
# Decode fusion, round 3, second device call: the fused KDA core with the gate rows' loads issued
# together (the first call's loop made 20 dependent round trips). P, OUT as decfuse.sh (no main
# binary needed: LUNAR_KDA_DECODE unset is main's KDA launch sequence). The op test, the forward
# tests with the fused core (goldens, kernel shapes vs CPU, graphs == eager), then Kimi-Linear-48B
# at batch 1 alternating split / fused / nogate, the K3.1 slice split / fused, and one profiled step.
#   P=.xfer-NAME OUT=/tmp/o tools/device/decfuse2.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=decfuse2.txt . tools/device/env.sh
L=$(mktemp -d)
nvidia-smi -L >> $T
step "lunar_tests cuda_kda"
OMP_NUM_THREADS=16 timeout 45 $P/bin/lunar_tests cuda_kda > $L/t_kda.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |bit-equal|CHECK' $L/t_kda.log | cut -c1-400 | tail -8 >> $T
step "LUNAR_KDA_DECODE=fused lunar_tests cuda_forward"
LUNAR_KDA_DECODE=fused OMP_NUM_THREADS=16 timeout 45 $P/bin/lunar_tests cuda_forward > $L/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $L/t_fwd.log | cut -c1-300 | tail -14 >> $T
KL="bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 1024"
K3="bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 8192"
run() { # TAG MODE ARGS...
  local tag=$1 mode=$2; shift 2
  step "$tag"
  if [ -n "$mode" ]; then export LUNAR_KDA_DECODE=$mode; else unset LUNAR_KDA_DECODE; fi
  timeout 25 $P/bin/lunar "$@" > $L/$tag.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $L/$tag.txt | head -5 >> $T; grep -iE 'graph|error|abort' $L/$tag.txt | head -3 >> $T
  unset LUNAR_KDA_DECODE
}
for r in 1 2; do
  run kl_split_$r "" $KL
  run kl_fused_$r fused $KL
  run kl_nogate_$r nogate $KL
done
run k3_split "" $K3
run k3_fused fused $K3
run kl_split_profile "" $KL --profile
sed -n '/^profile of one decode/,/sum/p' $L/kl_split_profile.txt >> $T
step done
(cd "$L" && tar czf "$OUT/all.tgz" -- *)
cat $T
