#!/usr/bin/env bash
# MLA decode, FP8 pages, round 6 (session 10): the round-6 kernel (LUNAR_MLA_WGMMA_FP8=st, S^T = K Q^T with
# heads as N, blocks of <= 32 heads) against round 5 (=rs2): op tests (every wgmma FP8 variant vs the CPU op,
# st included), the A/B kernel bench (bench_mla fp8ab: rs2 vs st, 4 alternating rounds), then Kimi-Linear's
# FP8 decode step (TPOT, B = 8 / 64, 32K) under LUNAR_MLA_DECODE=wgmma with =rs2 / =st in alternating rounds
# (and the default selection as a third column) while time is left.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla6.sh
set -u
P=${P:-.xfer-mla6}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla (st run included)"
LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 120 $P/bin/lunar_cuda_tests cuda_mla > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "mla wgmma decode|FAIL|passed|failed|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "heads as N|S one tile ahead" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-120 >> $T
step "bench_mla fp8ab (rs2 vs st)"
timeout 90 $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
K=configs/kimi-linear-48b-a3b.json
for round in 1 2 3; do
  for v in ${VARIANTS:-rs2 st def}; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-130} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=$v" ;; esac
    env $e timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
      --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s %s ms; ", $1, $3}' $OUT/b.log)" >> $T
  done
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log 2>/dev/null && rm -f b.log)
cat $T
