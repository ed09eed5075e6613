#!/usr/bin/env bash
# Issue 8, round 2: the tall-tile wgmma grouped GEMM (path 6, LUNAR_MOE_PREFILL=tall) vs path 4 in one
# device call of <= 60 s: the MoE op tests (paths 1-6 vs the CPU ops), the prefill bench (paths
# 2/4/5/6), the forward goldens with path 6 as the prefill default.
set -u
P=${P:-.xfer-moe2}   # prebuilt dir (tools/device/prebuild.sh)
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
left() { echo $(( 56 - ($(date +%s) - t0) )); }
nvidia-smi -L >> $T
step "lunar_tests cuda_moe (op tests, paths 1-6 vs CPU)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 20 $P/bin/lunar_tests cuda_moe > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |failed|wgmma tall' $OUT/t_moe.log | cut -c1-220 | tail -40 >> $T
step "LUNAR_MOE_BENCH=prefill lunar_tests cuda_moe_bench"
LUNAR_MOE_BENCH=prefill timeout 30 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured|passed' $OUT/bench.log >> $T
L=$(left); step "LUNAR_MOE_PREFILL=tall lunar_tests cuda_forward (left $L s)"
if [ "$L" -gt 8 ]; then
  LUNAR_MOE_PREFILL=tall OMP_NUM_THREADS=16 timeout $((L - 2)) $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |prefill median|differ' $OUT/t_fwd.log | cut -c1-260 | tail -12 >> $T
fi
step "done"
