#!/usr/bin/env bash
# MLA decode, FP8 pages, round 5, call 2 (session 9): the round-5 kernel as the default inside the wgmma
# path (blocks of <= 32 heads, from 64K rows x context) against LUNAR_MLA_WGMMA_FP8=rs (round 4): the
# kernel A/B again, the FP8 table (its default column), Kimi-Linear's FP8 decode step in alternating
# rounds (default / =rs, and LUNAR_MLA_DECODE=wgmma with each), then ncu per kernel of the B = 64 step.
#   P=<prebuilt dir with bin/, lib/> OUT=... tools/device/mla5b.sh   (build-device/ binaries in the tree)
set -u
P=${P:-.xfer-mla5}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
BD=build-device
step "bench_mla fp8ab"
timeout 60 $BD/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
step "bench_mla fp8"
timeout 60 $BD/bench_mla fp8 > $OUT/fp8.md 2>&1; echo "rc=$?" >> $T
K=configs/kimi-linear-48b-a3b.json
for round in 1 2 3; do
  for v in def defrs wg wgrs; do
    case $v in def) e=LUNAR_NONE=0 ;; defrs) e=LUNAR_MLA_WGMMA_FP8=rs ;; wg) e=LUNAR_MLA_DECODE=wgmma ;;
      wgrs) e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=rs" ;; esac
    env $e timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
      --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s %s ms; ", $1, $3}' $OUT/b.log)" >> $T
  done
done
for v in wg wgrs; do
  [ $(( $(date +%s) - t0 )) -gt ${NCU_BEFORE:-110} ] && { echo "skip ncu $v (time)" >> $T; continue; }
  e=LUNAR_MLA_DECODE=wgmma; [ $v = wgrs ] && e="LUNAR_MLA_DECODE=wgmma LUNAR_MLA_WGMMA_FP8=rs"
  step "ncu B=64 32K fp8 $v"
  env $e timeout 60 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum --csv \
    -k regex:'decode|merge' --launch-count 400 \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 64 --contexts 32768 \
    --kv-cache-dtype fp8 --steps 1 > $OUT/ncu_$v.csv 2> $OUT/ncu_$v.err; echo "ncu rc=$? [$e]" >> $T
  python3 tools/device/ncu_sum.py $OUT/ncu_$v.csv >> $T 2>&1
done
step done
(cd $OUT && tar czf logs.tgz ncu_* b.log 2>/dev/null && rm -f ncu_* b.log)
cat $T
