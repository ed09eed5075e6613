#!/usr/bin/env bash
# Issue 8, session 7 (branch s7-mx4): the MXFP4 decode pair on f16 tensor cores (path 16,
# LUNAR_MOE_DECODE=f16) against main's pair in one device call. Run from the repository root with
# P = the prebuilt directory (DIR/bin, DIR/lib, built here) and OUT = the folder that comes back:
# the MXFP4 / BF16 expert op tests (every decode path incl. 16 vs the CPU), the decode benchmark
# (pair / v2 / f16 with floor(m)), Nsight Compute on both pairs at K3.1 batch 1 (instructions,
# scheduler and warp state), the forward tests with path 16 forced, and the K3.1 TP8 slice's
# lunar bench pair vs f16, two rounds alternating.
#   P=.xfer-NAME OUT=/tmp/o tools/device/moedec7.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moedec7.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts (all decode paths incl. f16 vs the CPU)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|f16' $OUT/t_moe.log | cut -c1-160 | tail -40 >> $T
step "decode benchmark"
LUNAR_MOE_BENCH=decode timeout 150 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||Measured' $OUT/bench.log >> $T
K3="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 8192"
for r in 1 2; do for d in pair f16; do
  step "K3.1 slice LUNAR_MOE_DECODE=$d round $r"
  LUNAR_MOE_DECODE=$d timeout 40 $K3 > $OUT/k3_${d}_$r.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $OUT/k3_${d}_$r.txt | head -8 >> $T; grep -iE 'error|abort|project|floor' $OUT/k3_${d}_$r.txt | head -4 >> $T
done; done
NCU="ncu --clock-control none --section SchedulerStats --section WarpStateStats --section InstructionStats --section SpeedOfLight --metrics smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum"
step "ncu: the pair (gate/up, down), K3.1 batch 1"
LUNAR_MOE_BENCH=decode1 timeout 60 $NCU -k regex:'^moe_decode_kernel' --launch-count 2 $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_pair.txt 2>&1; echo "rc=$?" >> $T
step "ncu: f16 (gate/up, down), K3.1 batch 1"
LUNAR_MOE_BENCH=decode1 timeout 60 $NCU -k regex:'moe_decode_f16_kernel' --launch-count 2 $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_f16.txt 2>&1; echo "rc=$?" >> $T
for f in pair f16; do
  grep -E 'moe_decode|Duration|DRAM Through|Executed Ipc A|Issue Slots Busy|No Eligible|Issued Warp Per|Warp Cycles Per Issued|Executed Instructions  |inst_executed|dram__bytes|Active Warps Per' $OUT/ncu_$f.txt | head -40 >> $T
done
step "LUNAR_MOE_DECODE=f16 cuda_forward (goldens, graphs == eager)"
LUNAR_MOE_DECODE=f16 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -20 >> $T
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moedec7.txt -- *)
cat $T
