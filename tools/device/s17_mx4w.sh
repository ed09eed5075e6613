#!/usr/bin/env bash
# Session 17, issue 8, helper mx4w: path 16 at one token with the consumer on FP8 wgmma (LUNAR_MOE_F16_WG=1 | 2 | 4,
# cuda_moe_f16wg.cu). One call: the op test at K3.1's shape and its TP8 slice (f16_wg_case vs the CPU op), the
# pair A/B (f16ab: default, WG=1, 2, 4, the consumers alone with and without WG; rounds alternating), then the
# whole MXFP4 experts test (its one-token cases run f16_wg_case too) with the time left.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] bash tools/device/s17_mx4w.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader >> $T
step "op test: cuda_moe_experts_mxfp4_wg (K3.1 shape, TP8 slice)"
timeout 30 $P/bin/lunar_tests cuda_moe_experts_mxfp4_wg > $OUT/wgtest.log 2>&1; echo "rc=$?" >> $T
grep -E 'WG=|FAIL|CHECK|passed|failed' $OUT/wgtest.log | cut -c1-200 | head -30 >> $T
W=LUNAR_MOE_F16_WG S=LUNAR_MOE_F16_SKIP
V="def:LUNAR_NONE=0 wg:$W=1 wg2:$W=2 wg4:$W=4 cs:$S=3 wgcs:$W=1,$S=3"
step "decode pair at one token: $V (${ROUNDS:-3} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-3} timeout 40 $P/bin/lunar_tests \
  cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAIL|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
step "op test: cuda_moe_experts_mxfp4 (all; the time left)"
timeout ${LEFT:-40} $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/mxtest.log 2>&1; echo "rc=$?" >> $T
grep -E 'WG=|FAIL|CHECK|passed|failed' $OUT/mxtest.log | cut -c1-200 | head -30 >> $T
step "done"
cat $T
