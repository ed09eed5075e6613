#!/usr/bin/env bash
# Issue 8, session 5: the warp-specialised MoE prefill GEMM (path 6, LUNAR_MOE_PREFILL=ws) in one
# device call. Run from the repository root with P = the prebuilt directory (bin/, lib/ as
# prebuild.sh leaves them) and OUT = the folder that comes back:
#   P=.xfer-moepre OUT=/tmp/o tools/device/moe_ws.sh
# op tests (every path vs the CPU ops), the prefill benchmark (dense peak measured first; paths 2 /
# 4 / 6), the goldens with path 6 as the prefill default, Kimi-Linear-48B 8K prefill with path 4
# vs path 6 (--profile), and Nsight Compute on path 6's kernels where ncu exists.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moe_ws.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "op tests: cuda_moe (paths 1-6 vs the CPU ops)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 75 $P/bin/lunar_tests cuda_moe_ > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' ws |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -60 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill benchmark (LUNAR_MOE_BENCH=prefill)"
LUNAR_MOE_BENCH=prefill timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||Measured' $OUT/bench.log >> $T
step "cuda_forward with LUNAR_MOE_PREFILL=ws"
LUNAR_MOE_PREFILL=ws OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -20 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 1024 --profile"
for m in wg ws; do
  step "KL48 8K prefill LUNAR_MOE_PREFILL=$m"
  LUNAR_MOE_PREFILL=$m timeout 40 $KL > $OUT/kl_$m.txt 2>&1; echo "rc=$?" >> $T
  grep -iE 'prefill|expert|mfu|error|abort' $OUT/kl_$m.txt | head -12 >> $T
done
if command -v ncu > /dev/null; then
  step "ncu: path 6 kernels, Kimi-Linear shape (launches 28-29 of the bench)"
  LUNAR_MOE_BENCH=prefill timeout 45 ncu --clock-control none -k regex:moe_ws_kernel --launch-skip 28 -c 2 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu.txt 2>&1; echo "rc=$?" >> $T
  grep -E 'moe_ws_kernel|Duration|Throughput|Compute \(SM\)|Stall|Shared|L2 Hit|Issued' $OUT/ncu.txt | head -60 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moe_ws.txt -- *)
cat $T
