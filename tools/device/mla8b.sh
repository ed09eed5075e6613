#!/usr/bin/env bash
# MLA decode, FP8 pages, round 8, call 2 (session 12): call 1 found a launch's fixed cost at B = 8, 8K (41 us) in the
# block's set-up (8.7 us), its stores (4.9 us) and outside the kernel (12 us: launch, merge). Here: the new variant
# =s8s (s8 with the partial O stored as whole 32-byte sectors) under the op test (memcmp-equal to stlp), bench_mla
# fp8trace with the set-up split (init / copies / q / barrier) under three L2 states (flushed; flushed with q, lens
# and the block table back in L2; not flushed) to tell cold code from cold data, fp8ab stlp / s8 / s8s, then
# Kimi-Linear's FP8 TPOT (B = 8 / 64, 8K / 32K) in alternating rounds: default / =s8 / =s8s.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla8b.sh
# (Run at 8507b5e. Since then only =s8 is in the tree: =s8q / =s8d / =s8c / =s8s are in git show 8507b5e.)
set -u
P=${P:-.xfer-mla8}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla_wgmma, the s8s runs (memcmp-equal to stlp)"
LUNAR_TEST_MLA_FP8=s8s LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 40 \
  $P/bin/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "whole-sector" $OUT/t_mla.log | grep -c "max rel err" >> $T
grep -E "mla wgmma decode:.*whole" $OUT/t_mla.log | sort | uniq -c | cut -c1-220 >> $T
step "bench_mla fp8trace (stlp, s8, s8s; L2 flushed / data warm / all warm)"
timeout 40 $P/bin/bench_mla fp8trace > $OUT/trace.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/trace.md >> $T
step "bench_mla fp8ab (stlp s8 s8s)"
BENCH_MLA_AB="stlp s8 s8s" timeout 40 $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
K=configs/kimi-linear-48b-a3b.json
step "TPOT: default (stlp) / =s8 / =s8s"
for round in 1 2 3 4; do
  for v in def s8 s8s; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-80} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 8192,32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
  done
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log 2>/dev/null && rm -f b.log t_mla.log)
cat $T
