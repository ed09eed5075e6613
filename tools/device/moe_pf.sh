#!/usr/bin/env bash
# Issue 8, session 6 (MoE prefill, round 4): paths 10 / 11 (path 6 with the BF16 consumers'
# per-chunk async-proxy fence moved into the producer, arriving 2 / 1 chunks after its copies) in
# one device call. Run from the repository root with P = the prebuilt directory and OUT:
#   P=.xfer-moepre6 OUT=/tmp/o tools/device/moe_pf.sh
# op tests (every path vs the CPU ops), the prefill benchmark (dense peak measured first; paths 2 /
# 4 / 6 / 10 / 11 / 7), the goldens with LUNAR_MOE_PREFILL=wsf (BF16 path 10, MXFP4 path 4: the
# defaults if 10 wins), Kimi-Linear-48B 8K prefill default vs wsf (--profile), and Nsight Compute
# (warp states) on path 6's and path 10's Kimi-Linear kernels. Stops early past BUDGET seconds.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
BUDGET=${BUDGET:-105}
SUMMARY=moe_pf.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_ (paths 1-11 vs the CPU ops)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_ > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsf1? |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-160 | tail -50 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill benchmark (LUNAR_MOE_BENCH=prefill)"
LUNAR_MOE_BENCH=prefill timeout 50 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-150 >> $T
step "cuda_forward with LUNAR_MOE_PREFILL=wsf (BF16 path 10, MXFP4 path 4)"
LUNAR_MOE_PREFILL=wsf OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -16 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 1024 --profile"
for m in default wsf; do
  late $BUDGET && { step "skipped KL48 $m: past budget"; continue; }
  step "KL48 8K prefill LUNAR_MOE_PREFILL=$m"
  if [ $m = default ]; then timeout 25 $KL > $OUT/kl_$m.txt 2>&1; else LUNAR_MOE_PREFILL=$m timeout 25 $KL > $OUT/kl_$m.txt 2>&1; fi
  echo "rc=$?" >> $T
  grep -E '^ +8192 |experts|abort|rror' $OUT/kl_$m.txt | head -6 >> $T
done
if command -v ncu > /dev/null; then
  # mangled names: moe_ws_kernel<MX = false, GATEUP, CL = false, PF>
  for k in ILb0ELb1ELb0ELi0E ILb0ELb1ELb0ELi2E ILb0ELb0ELb0ELi2E; do
    late $BUDGET && { step "skipped ncu $k: past budget"; continue; }
    step "ncu Kimi-Linear moe_ws_kernel$k (first launch)"
    LUNAR_MOE_BENCH=prefill-bf16 timeout 30 ncu --clock-control none --kernel-name-base mangled -k regex:moe_ws_kernel$k -c 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$k.txt 2>&1
    echo "rc=$?" >> $T
    grep -E 'moe_ws_kernel|Duration|Throughput|L2 Hit|Warp Cycles|Issued' $OUT/ncu_$k.txt | cut -c1-150 | head -16 >> $T
    grep -E 'issue_stalled' $OUT/ncu_$k.txt | awk '$NF + 0 >= 0.05' | sed 's/smsp__average_warps_issue_stalled_//' | cut -c1-110 >> $T
  done
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moe_pf.txt -- * && rm -f kl_*.txt ncu_*.txt t_fwd.log)  # 8 files come back
cat $T
