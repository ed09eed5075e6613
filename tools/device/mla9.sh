#!/usr/bin/env bash
# MLA decode, FP8 pages, round 9 (session 13): the fixed cost of a small launch (issue 7). Round 8's trace found, at
# H = 32, B = 8, 8K, ~9 us of set-up (q's loads queued behind the first tiles' copies), ~14 us outside the blocks
# (the merge launch, the drain) and 1.40-1.45 us a tile. Switches of the st kernel against the default (stlp):
# =s9q (q's rows requested before the copies), =s9m (the split-K merge in the kernel's tail), =s9c (V^T by cvt,
# the tile's exp2 flushing below 2^-126), =s9 (the three). In order: the wgmma op test's round-9 runs (each
# memcmp-equal to stlp), bench_mla fp8trace (stlp / s9, L2 flushed), bench_mla fp8ab (4 rotated rounds) at the issue's
# four shapes and B = 8, 8K, then Kimi-Linear's FP8 TPOT (B = 8 / 64 at 32K) alternating default / =s9 while time
# is left.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla9.sh
# (Run at e86d66e, copied into the pack: tar xJf .xfer-mla8z/pack.tar.xz && P=.xfer-mla8 TPOT_BEFORE=30 AB_TIMEOUT=40
# bash .xfer-mla8/mla9.sh. Since then s9 / s9c are the defaults: =stlp is round 7.)
set -u
P=${P:-.xfer-mla8}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla_wgmma, round 9's runs (memcmp-equal to stlp)"
LUNAR_TEST_MLA_FP8="s9q s9m s9c s9" LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 45 \
  $P/bin/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "round 9" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-120 | sort | uniq -c | head -12 >> $T
grep -E "mla wgmma decode:.*(before the copies|merge in|exp2 ftz)" $OUT/t_mla.log | sort | uniq -c | cut -c1-220 >> $T
step "bench_mla fp8trace (stlp, s9; L2 flushed)"
BENCH_MLA_AB="stlp s9" BENCH_MLA_L2MODES=flush timeout 30 $P/bin/bench_mla fp8trace > $OUT/trace.md 2>&1
echo "rc=$?" >> $T
grep '^|' $OUT/trace.md >> $T
step "bench_mla fp8ab (stlp s9q s9m s9c s9)"
BENCH_MLA_AB="stlp s9q s9m s9c s9" BENCH_MLA_CASES="32 64 32768;32 8 131072;32 64 8192;32 8 32768;32 8 8192" \
  timeout ${AB_TIMEOUT:-50} $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1
echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
K=configs/kimi-linear-48b-a3b.json
step "TPOT: default (stlp) vs =s9"
for round in 1 2 3; do
  for v in def s9; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-50} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
    [ $round = 1 ] && grep -m3 "heads as N" $OUT/b.log | cut -c1-200 >> $T
    [ $round = 1 ] && [ $v = s9 ] && cp $OUT/b.log $OUT/b_s9.log
  done
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log b_s9.log 2>/dev/null && rm -f b.log t_mla.log b_s9.log)
cat $T
