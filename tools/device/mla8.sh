#!/usr/bin/env bash
# MLA decode, FP8 pages, round 8 (session 12): where the fixed cost of a launch goes at small sizes, and round 8's
# switches of the st kernel against the default (stlp): =s8q (q's rows loaded at once), =s8d (dependent launch),
# =s8c (the V^T fragments by cvt.rn.f16x2.e4m3x2), =s8 (all three). In order: the wgmma op test (the s8 runs
# memcmp-equal to stlp), bench_mla fp8trace (the traced instance: each block's phases), ncu's durations of the decode
# and merge kernels (one call, B = 8, 8K), bench_mla fp8ab (4 rotated rounds), fp8ab on the rising pool (the lazy
# rescale's worst case: stlp at threshold 0 redoes every tile), then Kimi-Linear's FP8 TPOT (B = 8 / 64, 8K / 32K)
# alternating default / =s8 while time is left.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla8.sh
# (Run at a992e71. Since then only =s8 is in the tree: =s8q / =s8d / =s8c / =s8s are in git show 8507b5e.)
set -u
P=${P:-.xfer-mla8}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla_wgmma (s8q / s8d / s8c / s8 memcmp-equal to stlp)"
LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "round 8" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-120 | sort | uniq -c | head -12 >> $T
grep -E "mla wgmma decode:.*(q rows|dependent|cvt)" $OUT/t_mla.log | sort | uniq -c | cut -c1-200 >> $T
step "bench_mla fp8trace (stlp, s8)"
timeout 40 $P/bin/bench_mla fp8trace > $OUT/trace.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/trace.md >> $T
step "ncu: decode and merge kernels, H = 32, B = 8, 8K, default (two calls)"
BENCH_MLA_CASE="32 8 8192" timeout 40 ncu --clock-control none --metrics gpu__time_duration.sum,sm__cycles_active.avg \
  -k regex:"wgmma_decode_st|merge" --launch-skip 2 --launch-count 4 $P/bin/bench_mla fp8one > $OUT/ncu.txt 2>&1
echo "rc=$?" >> $T
grep -E "wgmma_decode_st|merge_kernel|gpu__time_duration|sm__cycles_active|ERROR" $OUT/ncu.txt | sed 's/  */ /g' | cut -c1-120 >> $T
step "bench_mla fp8ab (stlp s8q s8d s8c s8)"
BENCH_MLA_AB="stlp s8q s8d s8c s8" timeout 70 $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
step "bench_mla fp8ab, rising pool (st, stlp, stlp at threshold 0, s8 at 0)"
BENCH_MLA_GROW=1 BENCH_MLA_AB="st stlp stlp:0 s8:0" BENCH_MLA_CASES="32 8 8192;32 8 32768;32 64 8192" \
  timeout 40 $P/bin/bench_mla fp8ab > $OUT/grow.md 2>&1; echo "rc=$?" >> $T
grep -E '^\||rising' $OUT/grow.md >> $T
K=configs/kimi-linear-48b-a3b.json
step "TPOT: default (stlp) vs =s8"
for round in 1 2 3; do
  for v in def s8; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-110} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 8192,32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
    [ $round = 1 ] && grep -m2 "heads as N" $OUT/b.log | cut -c1-160 >> $T
    [ $round = 1 ] && [ $v = def ] && cp $OUT/b.log $OUT/b_def1.log
  done
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log b_def1.log ncu.txt 2>/dev/null && rm -f b.log t_mla.log ncu.txt)
cat $T
