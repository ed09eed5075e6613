#!/usr/bin/env bash
# Session 10, the lead's last call (one H200): main after the session's merges. session7_final.sh (check.sh's op
# tests, goldens, engine, generate, serve; the model-level CUDA tests; issue 9's table; A/B rounds of the session's
# switches: AB / PF_AB as there), then two binary A/Bs at Kimi-Linear B=1 (binab.sh): the build before the
# per-head norm's gate-load fix (bin/lunar_prenorm) against main, and session 7's 689e6a8 (bin/lunar_old) against
# main (session 9 measured 689e6a8 2.5 % faster: is the gap closed?); the 8K prefill of the build before the BF16
# grouped GEMMs' epilogue fix (bin/lunar_preep) against main, and the BF16 MoE prefill kernel table of both builds.
#   P=<prebuilt dir> [AB="..."] [PF_AB="..."] [TESTS="..."] [LLAMA=<llama-bench>] tools/device/session10_final.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
export P OUT
SKIP_AB=${SKIP_AB:-1} TESTS="${TESTS:-cuda_forward cuda_moe_ cuda_kda cuda_mla cuda_norms cuda_matmul}" \
  bash tools/device/session7_final.sh > /dev/null 2>&1
SUMMARY=s10.txt . tools/device/env.sh
for old in lunar_prenorm lunar_old; do
  [ -x "$P/bin/$old" ] || continue
  step "binab: $old (A) vs main (B), Kimi-Linear B=1"
  A=$P/bin/$old B=$P/bin/lunar ROUNDS=${ROUNDS:-2} timeout 200 tools/device/binab.sh > /dev/null 2>&1
  cat $OUT/binab.txt >> $T; mv $OUT/binab.txt $OUT/binab_$old.txt; mv $OUT/binab.tgz $OUT/binab_$old.tgz 2>/dev/null
done
if [ -x "$P/bin/lunar_preep" ]; then
  step "binab PREFILL=1: lunar_preep (A, before the BF16 epilogue's row-weight fix) vs main (B), Kimi-Linear 8K"
  PREFILL=1 A=$P/bin/lunar_preep B=$P/bin/lunar ROUNDS=${ROUNDS:-2} timeout 240 tools/device/binab.sh > /dev/null 2>&1
  cat $OUT/binab.txt >> $T; mv $OUT/binab.txt $OUT/binab_preep.txt; mv $OUT/binab.tgz $OUT/binab_preep.tgz 2>/dev/null
fi
for tb in lunar_tests_preep lunar_tests; do
  [ -x "$P/bin/$tb" ] || continue
  step "BF16 MoE prefill kernels ($tb)"
  OMP_NUM_THREADS=16 LUNAR_MOE_BENCH=prefill-bf16 timeout 90 $P/bin/$tb cuda_moe_bench > $OUT/moe_pf_$tb.log 2>&1
  echo "rc=$?" >> $T; grep -E '^\||Measured' $OUT/moe_pf_$tb.log | head -30 >> $T
done
step done
cat $OUT/final.txt $T
