#!/usr/bin/env bash
# Programmatic dependent launch (issue 9, round 2), in one device call: run from the repository
# root with P = the prebuilt directory (DIR/bin, DIR/lib as prebuild.sh leaves them; nothing is
# built here) and OUT = the folder that comes back. The graphs tests (among them graphs with PDL ==
# eager without, bit for bit), every cuda_forward test with LUNAR_CUDA_PDL=1 (eager and graphs vs
# the CPU), then lunar bench at batch 1 with PDL off and on: Kimi-Linear-48B-A3B (twice each,
# alternating, for the run-to-run noise) and the K3.1 TP8 slice (10 layers, projected to 93).
#   P=.xfer-NAME OUT=/tmp/o tools/device/pdl.sh      (session 4: .xfer-fuse2/call.sh, the same)
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=pdl.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "graphs tests (PDL as the environment says; incl. cuda_forward_graphs_pdl_match_eager)"
OMP_NUM_THREADS=16 timeout 20 $P/bin/lunar_tests cuda_forward_graphs > $OUT/t_graphs.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_graphs.log | cut -c1-240 | tail -24 >> $T
step "cuda_forward with LUNAR_CUDA_PDL=1 (eager and graphs vs CPU)"
LUNAR_CUDA_PDL=1 OMP_NUM_THREADS=16 timeout 25 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd_pdl.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd_pdl.log | cut -c1-240 | tail -30 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 1024"
K3="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 8192"
for r in 1 2; do for pdl in 0 1; do
  step "KL48 B=1 PDL=$pdl run $r"
  LUNAR_CUDA_PDL=$pdl timeout 15 $KL > $OUT/kl_${pdl}_$r.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/kl_${pdl}_$r.txt | head -4 >> $T; grep -iE 'graph|error|abort' $OUT/kl_${pdl}_$r.txt | head -3 >> $T
done; done
for pdl in 0 1; do
  step "K3.1 slice B=1 PDL=$pdl"
  LUNAR_CUDA_PDL=$pdl timeout 15 $K3 > $OUT/k3_${pdl}.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/k3_${pdl}.txt | head -6 >> $T; grep -iE 'graph|error|abort|project' $OUT/k3_${pdl}.txt | head -4 >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=pdl.txt -- *)
cat $T
