#!/usr/bin/env bash
# Decode fusion, round 3 (issue 9), in one device call on one H200: run from the repository root with
# P = the prebuilt directory (P/bin/lunar and lunar_tests of this branch, P/lib, and P/main/lunar =
# main's binary, the baseline) and OUT = the folder that comes back. Op tests (the fused KDA decode
# core vs the CPU ops and the launches it replaces; the KDA, norm, MLA, DSA, AttnRes, sampling ops,
# now launched with PDL), the forward tests (goldens and kernel-shaped models vs the CPU, graphs ==
# eager bit for bit, graphs with PDL == eager without), then lunar bench at batch 1 alternating
# main / this branch (LUNAR_KDA_DECODE unset = the fused core with the gates, =nogate, =split),
# Kimi-Linear-48B and the K3.1 TP8 slice (10 layers, projected to 93); the optional parts stop
# once the script has run BUDGET seconds.
#   P=.xfer-NAME OUT=/tmp/o tools/device/decfuse.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
BUDGET=${BUDGET:-150}
SUMMARY=decfuse.txt . tools/device/env.sh
L=$(mktemp -d) # the logs, returned as one archive (at most 8 files come back)
nvidia-smi -L >> $T
echo "nsys: $(command -v nsys || echo none)" >> $T
left() { [ $(( $(date +%s) - t0 )) -lt "$BUDGET" ]; }
for f in cuda_kda cuda_norms cuda_mla_absorbed cuda_mla_sparse cuda_mla_wgmma cuda_dsa cuda_attnres_fused cuda_sample \
         cuda_forward; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 45 $P/bin/lunar_tests $f > $L/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |bit-equal|steps differ|CHECK' $L/t_$f.log | cut -c1-300 | tail -12 >> $T
done
KL="bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 1024"
K3="bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 8192"
run() { # TAG BIN MODE ARGS...
  local tag=$1 bin=$2 mode=$3; shift 3
  step "$tag"
  LUNAR_KDA_DECODE=$mode timeout 25 $bin "$@" > $L/$tag.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $L/$tag.txt | head -5 >> $T; grep -iE 'graph|error|abort|project' $L/$tag.txt | head -3 >> $T
}
run kl_fused_1 $P/bin/lunar "" $KL
run kl_main_1 $P/main/lunar "" $KL
run kl_split_1 $P/bin/lunar split $KL
run kl_fused_2 $P/bin/lunar "" $KL
run kl_main_2 $P/main/lunar "" $KL
run k3_fused $P/bin/lunar "" $K3
run k3_main $P/main/lunar "" $K3
left && run kl_nogate_1 $P/bin/lunar nogate $KL
left && run kl_split_2 $P/bin/lunar split $KL
left && run k3_split $P/bin/lunar split $K3
left && run kl_fused_profile $P/bin/lunar "" $KL --profile
step done
(cd "$L" && tar czf "$OUT/all.tgz" -- *)
cat $T
