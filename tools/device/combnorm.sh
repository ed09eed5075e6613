#!/usr/bin/env bash
# Session 8, issue 9 (branch s8-combnorm): the MoE combine folded into the residual add + RMSNorm after it
# (lunar_cuda_moe_combine_add_rmsnorm, opt-in LUNAR_COMBINE_NORM=1). The op test (bit-equal to combine +
# add_rmsnorm, and the CPU), the model tests with the fold on (cuda_forward_combine_norm_bit_equal: folded vs
# unfolded logits memcmp; graphs == eager), then Kimi-Linear A/B rounds alternating old (default) and new: one
# bench per run, the 8K prefill and decode B=1,8 at ctx 1024. ~60 s; FWD=1 adds all of cuda_forward (fold on).
#   P=<prebuilt dir> OUT=<dir> [AB_S=s: no further round after s seconds] [FWD=1] tools/device/combnorm.sh
set -u
P=${P:-.xfer-combnorm}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
step "lunar_tests cuda_moe_combine (LUNAR_COMBINE_NORM=1)"
LUNAR_COMBINE_NORM=1 LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 20 $P/bin/lunar_tests cuda_moe_combine \
  > $OUT/t_cn.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|n=300 k=16 D=2304 shared bf16' $OUT/t_cn.log | cut -c1-160 | tail -6 >> $T
step "lunar_tests cuda_add_rmsnorm cuda_norms (norm_vec_kernel's tail now shared with the fold)"
for f in cuda_add_rmsnorm cuda_norms; do
  OMP_NUM_THREADS=16 timeout 15 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -3 >> $T
done
for f in cuda_forward_combine_norm cuda_forward_graphs ${FWD:+cuda_forward}; do
  step "lunar_tests $f (LUNAR_COMBINE_NORM=1)"
  LUNAR_COMBINE_NORM=1 OMP_NUM_THREADS=16 timeout $([ $f = cuda_forward ] && echo 90 || echo 20) $P/bin/lunar_tests $f \
    > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -6 >> $T
done
res() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "prefill %s: %s s (MFU %s)  ", $1, $2, $NF}'
  grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; }
bench() { # name, env (comma-separated)
  env ${2//,/ } timeout 20 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
    --batch-sizes 1,8 --contexts 1024 --steps 64 > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(res $OUT/b_$1.log)" >> $T
}
for r in 1 2; do
  step "A/B round $r"
  if [ $r = 1 ]; then bench old_$r LUNAR_COMBINE_NORM=0; bench new_$r LUNAR_COMBINE_NORM=1
  else bench new_$r LUNAR_COMBINE_NORM=1; bench old_$r LUNAR_COMBINE_NORM=0; fi
  [ $(( $(date +%s) - t0 )) -gt ${AB_S:-35} ] && break
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=summary.txt -- * && rm -rf t_* b_*)
cat $T
