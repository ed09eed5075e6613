#!/usr/bin/env bash
# Session 15, s15-kdai4 (issue 7), one call on one H200: which part of the tensor-core KDA intra form (tc)
# loses accuracy, and a form as accurate as fast at tc-like speed. Forms (LUNAR_KDA_INTRA): fast, tc,
# diag (tc, the inverse's level products in fp32), inv3 (tc, the level products in 3xTF32), dg3 (tc, the
# diagonal blocks' tiles of step 4a' in 3xTF32), tc3 (dg3 + inv3).
#  1. lunar_tests cuda_forward_k3_shapes under each form, a process each (the "vs CPU" lines)
#  2. lunar_tests cuda_kda_chunked (every KDA chunked test; cuda_kda_chunked_intra_forms: each form vs the
#     CPU op, max and rms error, random and correlated keys)
#  3. bench_cuda kdadiag: T = 8K / 64K, H = 96 / 32, the forms FORMS alternating, ROUNDS rounds
#  4. (while under PF_S s) bench_cuda prefill2 per form
# The call runs in the session's checkout, not this worktree: carry this script in the pack (cp it into P).
#   P=<prebuilt dir: bin/lunar_tests, bd/bench_cuda, lib/> OUT=<dir> bash P/kdai4.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
late() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
step "lunar_tests cuda_forward_k3_shapes per form"
for v in ${FWD_FORMS:-fast tc inv3 diag tc3 dg3}; do
  late ${FWD_S:-60} || { echo "(skipped $v: time)" >> $T; continue; }
  LUNAR_KDA_INTRA=$v OMP_NUM_THREADS=16 timeout 15 $P/bin/lunar_tests cuda_forward_k3_shapes > $OUT/f_$v.log 2>&1
  echo "-- $v rc=$? $(grep -cE 'FAIL' $OUT/f_$v.log) FAIL lines" >> $T
  grep -E 'vs CPU' $OUT/f_$v.log | sed 's/^ *//; s/bf16 operands), median\/worst row: //' | cut -c1-200 >> $T
done
step "lunar_tests cuda_kda_chunked"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout ${TEST_S:-40} $P/bin/lunar_tests cuda_kda_chunked > $OUT/t_kda.log 2>&1
echo "rc=$?" >> $T
tr '\n' '~' < $OUT/t_kda.log | sed 's/~    /\n/g; s/~/\n/g' | grep -E 'kda form' | sed 's/max rel err/max/' | cut -c1-120 >> $T
grep -E 'FAIL|failed|passed, ' $OUT/t_kda.log | cut -c1-200 | tail -8 >> $T
step "bench_cuda kdadiag FORMS=${FORMS:-1 2 4 3 6}"
FORMS="${FORMS:-1 2 4 3 6}" ROUNDS=${ROUNDS:-2} timeout ${BENCH_S:-45} $P/bd/bench_cuda kdadiag > $OUT/bench_diag.md 2>&1; echo "rc=$?" >> $T
grep '^| kda intra' $OUT/bench_diag.md | sed 's/| kda intra //' | cut -c1-150 >> $T
if late ${PF_S:-95}; then
  step "bench_cuda prefill2 per form"
  for v in ${PF_FORMS:-fast inv3}; do
    late ${PF_S:-95} || break
    echo "-- LUNAR_KDA_INTRA=$v" >> $OUT/bench_pf.md
    LUNAR_KDA_INTRA=$v timeout 15 $P/bd/bench_cuda prefill2 >> $OUT/bench_pf.md 2>&1
  done
  grep -E '^-- LUNAR|^\| kda prefill' $OUT/bench_pf.md | cut -c1-150 >> $T
fi
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt -delete)
cat $T
