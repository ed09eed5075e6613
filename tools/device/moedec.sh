#!/usr/bin/env bash
# The MoE decode kernels (issue 8, session 5) in one device call: run from the repository root with
# P = the prebuilt directory (prebuild.sh's DIR/bin, DIR/lib; nothing is built here) and OUT = the
# folder that comes back. The MoE op tests (every path vs the CPU, v2 included), the decode
# benchmark (pair vs v2 vs fused, the read floor measured in the same process), the forward tests
# with the v2 kernels as the decode path (LUNAR_MOE_DECODE=v2: eager and graphs vs the CPU, graphs
# with PDL == eager bit for bit), then lunar bench, old (pair) vs new (v2) by the environment:
# Kimi-Linear-48B-A3B at batch 1, 8, 64 and the K3.1 TP8 slice (10 layers, projected to 93).
#   P=.xfer-NAME OUT=/tmp/o tools/device/moedec.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moedec.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "op tests: cuda_moe"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_moe > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK| v2' $OUT/t_moe.log | cut -c1-200 | tail -40 >> $T
step "decode benchmark"
LUNAR_MOE_BENCH=decode timeout 120 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||Measured' $OUT/bench.log >> $T
for t in cuda_forward_graphs cuda_forward; do
  step "LUNAR_MOE_DECODE=v2 $t"
  LUNAR_MOE_DECODE=v2 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests $t > $OUT/t_$t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_$t.log | cut -c1-200 | tail -12 >> $T
done
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 1024"
K3="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1,64 --contexts 8192"
for d in pair v2; do
  step "KL48 LUNAR_MOE_DECODE=$d"
  LUNAR_MOE_DECODE=$d timeout 40 $KL > $OUT/kl_$d.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/kl_$d.txt | head -8 >> $T; grep -iE 'error|abort' $OUT/kl_$d.txt | head -3 >> $T
  step "K3.1 slice LUNAR_MOE_DECODE=$d"
  LUNAR_MOE_DECODE=$d timeout 30 $K3 > $OUT/k3_$d.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/k3_$d.txt | head -8 >> $T; grep -iE 'error|abort|project' $OUT/k3_$d.txt | head -4 >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moedec.txt -- *)
cat $T
