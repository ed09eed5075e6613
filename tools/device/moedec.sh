#!/usr/bin/env bash
# The MoE decode kernels (issues 8 and 9, session 5) in one device call: run from the repository
# root with P = the prebuilt directory (prebuild.sh's DIR/bin, DIR/lib; nothing is built here) and
# OUT = the folder that comes back. The MoE op tests (every path vs the CPU, v2 and the shared
# expert as a routed row included), the decode benchmark (pair vs v2 vs fused, the read floor
# measured in the same process), the forward tests (the branch's defaults; the v2 kernels under
# graphs), then lunar bench with old (main's path) vs new by the environment, twice alternating:
# Kimi-Linear-48B-A3B at batch 1, 8, 64; the K3.1 TP8 slice (10 layers, projected to 93) pair vs v2.
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
step "cuda_forward (eager and graphs vs the CPU, graphs with PDL == eager; call 2 ran it with the shared row as the default)"
OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -30 >> $T
step "LUNAR_MOE_DECODE=v2 cuda_forward_graphs"
LUNAR_MOE_DECODE=v2 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward_graphs > $OUT/t_graphs_v2.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_graphs_v2.log | cut -c1-200 | tail -12 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 1024"
K3="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1,64 --contexts 8192"
# old = main's path (the kernel pair, shared expert on the side stream), new = this branch's default
for r in 1 2; do for v in "LUNAR_MOE_DECODE=pair LUNAR_MOE_SHARED_ROW=0" "LUNAR_MOE_DECODE=auto LUNAR_MOE_SHARED_ROW=1"; do
  f=kl_$(echo "$v" | tr -cd 'a-z0-9')_$r.txt
  step "KL48 $v run $r"
  env $v timeout 40 $KL > $OUT/$f 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/$f | head -5 >> $T; grep -iE 'graph|error|abort' $OUT/$f | head -3 >> $T
done; done
step "KL48 LUNAR_MOE_DECODE=v2 (shared row on)"
LUNAR_MOE_DECODE=v2 timeout 40 $KL > $OUT/kl_v2.txt 2>&1; echo "rc=$?" >> $T
sed -n '/^decode/,$p' $OUT/kl_v2.txt | head -5 >> $T
for d in pair v2; do
  step "K3.1 slice LUNAR_MOE_DECODE=$d"
  LUNAR_MOE_DECODE=$d timeout 30 $K3 > $OUT/k3_$d.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/k3_$d.txt | head -8 >> $T; grep -iE 'error|abort|project' $OUT/k3_$d.txt | head -4 >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moedec.txt -- *)
cat $T
