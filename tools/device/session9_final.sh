#!/usr/bin/env bash
# Session 9, the lead's last call (one H200): main after the session's merges. session7_final.sh (check.sh's op
# tests, goldens, engine, generate, serve; the model-level CUDA tests; issue 9's table), then the BF16 MoE prefill
# kernel table (paths 12 / 17 / 18 side by side: path 18, the cluster multicast with CTA-scope releases, had not run
# on a device), then session 7's last binary against main's at Kimi-Linear B=1 (binab.sh: is the 2-4 % B=1 shift
# between sessions 7 and 8 code or device?), and the KDA state pass old vs warp-specialised (bench_cuda kdastate).
#   P=<prebuilt dir with bin/lunar_old> [TESTS="..."] [LLAMA=<llama-bench>] tools/device/session9_final.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
export P OUT
SKIP_AB=1 TESTS="${TESTS:-cuda_forward cuda_moe_ cuda_kda cuda_mla}" bash tools/device/session7_final.sh > /dev/null 2>&1
SUMMARY=s9.txt . tools/device/env.sh
step "BF16 MoE prefill kernels (paths 12, 17, 18)"
OMP_NUM_THREADS=16 LUNAR_MOE_BENCH=prefill-bf16 timeout 90 $P/bin/lunar_tests cuda_moe_bench > $OUT/moe_pf.log 2>&1
echo "rc=$?" >> $T; grep -E '^\||Measured' $OUT/moe_pf.log | head -30 >> $T
step "KDA state pass, old vs ws (bench_cuda kdastate)"
timeout 60 build-device/bench_cuda kdastate > $OUT/kdastate.log 2>&1
echo "rc=$?" >> $T; grep -E '^\|' $OUT/kdastate.log | head -12 >> $T
if [ -x "$P/bin/lunar_old" ]; then
  step "binab: session 7's 689e6a8 (A) vs main (B), Kimi-Linear B=1"
  A=$P/bin/lunar_old B=$P/bin/lunar ROUNDS=${ROUNDS:-2} timeout 200 tools/device/binab.sh > /dev/null 2>&1
  cat $OUT/binab.txt >> $T
fi
step done
cat $OUT/final.txt $T
