#!/usr/bin/env bash
# MLA decode, FP8 pages, round 6, call 2 (session 10): the round-6 kernel as the default (inside the wgmma
# path at blocks of <= 32 heads from 64K rows x context, and FP8 pages always on the wgmma path): op tests
# (st4 bitwise against st), the kernel A/B (rs2 / st / st4, rotated rounds), the FP8 table (its st, default
# and new columns), then Kimi-Linear's FP8 decode step (TPOT, B = 8 / 64, 32K) in alternating rounds: the
# default, =rs2 (round 5 on the wgmma path), LUNAR_MLA_DECODE=new (mma.sync: B = 64's default before) and =st4.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla6b.sh
set -u
P=${P:-.xfer-mla6}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla (st default, st4 bitwise vs st)"
LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 120 $P/bin/lunar_cuda_tests cuda_mla > $OUT/t_mla.log 2>&1
rc=$?; echo "rc=$rc" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "heads as N|4 stages" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-110 >> $T
[ $rc = 0 ] || { echo "tests failed: stop" >> $T; cat $T; exit 1; }
step "bench_mla fp8ab (rs2 / st / st4)"
timeout 60 $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
step "bench_mla fp8"
timeout 60 $P/bin/bench_mla fp8 > $OUT/fp8.md 2>&1; echo "rc=$?" >> $T
K=configs/kimi-linear-48b-a3b.json
for round in 1 2 3; do
  for v in def rs2 new st4; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-125} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; new) e=LUNAR_MLA_DECODE=new ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
      --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s %s ms; ", $1, $3}' $OUT/b.log)" >> $T
  done
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log 2>/dev/null && rm -f b.log)
cat $T
