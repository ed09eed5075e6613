#!/usr/bin/env bash
# Issue 8, session 5, second call: path 6 (warp-specialised wgmma, now the BF16 prefill default) and
# path 7 (path 6 in clusters of 2 sharing the BF16 weight tiles by TMA multicast, opt-in
# LUNAR_MOE_PREFILL=wsc). Run from the repository root with P = the prebuilt directory and OUT:
#   P=.xfer-moepre OUT=/tmp/o tools/device/moe_ws2.sh
# op tests (paths 1-7 vs the CPU ops), the prefill benchmark with path 6 / 7 timing probes (removed from main since), the
# goldens with the new defaults, Kimi-Linear-48B 8K prefill with paths 6 (default), 4 and 7, and
# Nsight Compute on path 7's Kimi-Linear kernels and path 6's K3.1 MXFP4 gate/up kernel.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moe_ws2.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "op tests: cuda_moe (paths 1-7 vs the CPU ops)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_ > $OUT/t_moe.log 2>&1; rc=$?; echo "rc=$rc" >> $T
grep -E ' wsc? |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -70 >> $T
NO7=0; if [ $rc = 124 ]; then NO7=1; echo "op tests timed out (path 7 hang?): path 7 skipped below" >> $T; tail -3 $OUT/t_moe.log >> $T; fi
step "prefill benchmark (LUNAR_MOE_BENCH=prefill)"
LUNAR_MOE_BENCH=prefill timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||Measured' $OUT/bench.log >> $T
step "cuda_forward with the default prefill paths (BF16: 6, MXFP4: 4)"
OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -20 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 1024 --profile"
for m in default wg wsc; do
  [ $m = wsc ] && [ $NO7 = 1 ] && continue
  step "KL48 8K prefill LUNAR_MOE_PREFILL=$m"
  if [ $m = default ]; then timeout 30 $KL > $OUT/kl_$m.txt 2>&1; else LUNAR_MOE_PREFILL=$m timeout 30 $KL > $OUT/kl_$m.txt 2>&1; fi
  echo "rc=$?" >> $T
  grep -E '^ +8192 |experts|abort|rror' $OUT/kl_$m.txt | head -6 >> $T
done
if command -v ncu > /dev/null; then
  if [ $NO7 = 0 ]; then
    step "ncu: path 7 kernels, Kimi-Linear shape (launches 98-99 of the bench)"
    LUNAR_MOE_BENCH=prefill timeout 40 ncu --clock-control none -k regex:moe_ws_kernel --launch-skip 98 -c 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu7.txt 2>&1
    echo "rc=$?" >> $T
    grep -E 'moe_ws_kernel|Duration|Throughput|L2 Hit' $OUT/ncu7.txt | head -30 >> $T
  fi
  step "ncu: path 6 MXFP4 gate/up, K3.1 shape (launch 0)"
  LUNAR_MOE_BENCH=prefill timeout 40 ncu --clock-control none -k regex:moe_ws_kernel -c 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu6mx.txt 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe_ws_kernel|Duration|Throughput|L2 Hit|Stall|stalled' $OUT/ncu6mx.txt | head -30 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moe_ws2.txt -- * && rm -f kl_*.txt)  # 8 files come back
cat $T
