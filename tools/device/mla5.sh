#!/usr/bin/env bash
# MLA decode, FP8 pages, round 5 (session 9): the round-5 kernel (LUNAR_MLA_WGMMA_FP8=rs2, S one tile
# ahead) against the round-4 kernel (=rs): op tests (every wgmma FP8 variant vs the CPU op, rs2 bitwise
# against rs), the A/B kernel bench (bench_mla fp8ab: 4 alternating rounds), the full FP8 table, then
# Kimi-Linear's FP8 decode step (TPOT, B = 8 / 64, 32K) under rs and rs2 while time is left.
#   P=<prebuilt dir with bin/, lib/> OUT=... tools/device/mla5.sh   (build-device/ binaries in the tree)
set -u
P=${P:-.xfer-mla5}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
BD=build-device
step "lunar_cuda_tests cuda_mla (rs2 run included)"
LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 150 $BD/lunar_cuda_tests cuda_mla > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "mla wgmma decode|FAIL|passed|failed|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "S one tile ahead|V\^T in registers" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-120 >> $T
step "bench_mla fp8ab"
timeout 90 $BD/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
cat $OUT/fp8ab.md >> $T
step "bench_mla fp8"
timeout 60 $BD/bench_mla fp8 > $OUT/fp8.md 2>&1; echo "rc=$?" >> $T
K=configs/kimi-linear-48b-a3b.json
for r in rs2 rs; do
  [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-100} ] && { echo "skip TPOT $r (time)" >> $T; continue; }
  step "lunar bench $r"
  LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=$r timeout 70 $P/bin/lunar bench $K --load-format dummy --backend cuda \
    --input-lens 1024 --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/b_$r.log 2>&1; echo "rc=$? [$r]" >> $T
  grep -A3 '^decode ' $OUT/b_$r.log >> $T
done
step done
(cd $OUT && tar czf logs.tgz t_*.log b_*.log 2>/dev/null && rm -f t_*.log b_*.log)
cat $T
