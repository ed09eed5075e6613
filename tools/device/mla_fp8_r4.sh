#!/usr/bin/env bash
# MLA decode, FP8 pages, round 4 (session 8): the op tests with the new default (the round-4 kernel from
# 64K rows x context inside the wgmma path), bench_mla fp8, and the Kimi-Linear FP8 step at B = 64, 32K under
# ncu per kernel (default = mma.sync there, rs, widen): the kernel bench has rs at 650 us a layer against
# mma.sync's 977, the model step tied (docs/benchmarks.md, "... round 4"); then TPOT at B = 8 / 64.
#   P=<prebuilt dir with bin/, lib/, bd/bench_mla> OUT=... tools/device/mla_fp8_r4.sh
set -u
P=${P:-.xfer-mla4}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_tests cuda_mla"
LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 120 $P/bin/lunar_tests cuda_mla > $OUT/t_mla.log 2>&1; echo "rc=$?" >> $T
grep -E "mla wgmma decode|FAILED|passed|CHECK" $OUT/t_mla.log | sort | uniq -c | cut -c1-160 >> $T
step "bench_mla fp8"
timeout 200 $P/bd/bench_mla fp8 > $OUT/fp8.md 2>&1; echo "rc=$?" >> $T
K=configs/kimi-linear-48b-a3b.json
for r in def rs wid; do
  e=LUNAR_NONE=0; [ $r = rs ] && e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=rs"; [ $r = wid ] && e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=widen"
  step "ncu B=64 32K fp8 $r"
  env $e timeout 120 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum --csv \
    -k regex:'decode|merge' --launch-count 400 \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 64 --contexts 32768 \
    --kv-cache-dtype fp8 --steps 1 > $OUT/ncu_$r.csv 2> $OUT/ncu_$r.err; echo "ncu rc=$? [$e]" >> $T
  python3 tools/device/ncu_sum.py $OUT/ncu_$r.csv >> $T 2>&1
done
for r in def rs wid; do
  step "lunar bench $r"
  e=LUNAR_NONE=0; [ $r = rs ] && e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=rs"; [ $r = wid ] && e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=widen"
  env $e timeout 150 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
    --contexts 32768 --kv-cache-dtype fp8 > $OUT/b_$r.log 2>&1; echo "rc=$? [$e]" >> $T
  grep -A3 '^decode ' $OUT/b_$r.log >> $T
done
step done
(cd $OUT && tar czf logs.tgz t_*.log b_*.log ncu_* && rm -f t_*.log b_*.log ncu_*)
cat $T
