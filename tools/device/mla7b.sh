#!/usr/bin/env bash
# MLA decode, FP8 pages, round 7, call 2 (session 11): the new default (st with the lazy rescale and the tile's
# wait at its top, =stlp) against round 6 (=st) in Kimi-Linear's FP8 decode step (TPOT, B = 8 / 64, 32K),
# alternating rounds, then ncu (application replay: bench_mla's 15 GB of pools make kernel replay's memory
# save too slow) on one launch of each at H = 32, B = 64, 32K: speed of light, warp states, pipes.
#   P=<dir with bin/ (lunar, bench_mla) and lib/> OUT=... tools/device/mla7b.sh
set -u
P=${P:-.xfer-mla7}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
step "TPOT: default (stlp) vs =st"
for round in 1 2 3; do
  for v in def st; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-40} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_MLA_WGMMA_VERBOSE=1 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
      --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s %s ms; ", $1, $3}' $OUT/b.log)" >> $T
    [ $v = def ] && grep -m1 "heads as N" $OUT/b.log | cut -c1-130 >> $T
  done
done
for v in def st; do
  [ $(( $(date +%s) - t0 )) -gt ${NCU_BEFORE:-75} ] && { echo "skip ncu $v (time)" >> $T; continue; }
  step "ncu $v (H = 32, B = 64, 32K, one launch, application replay)"
  case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
  env $e timeout 40 ncu --clock-control none --replay-mode application --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum \
    --page raw -k regex:wgmma_decode_st --launch-skip 1 --launch-count 1 $P/bin/bench_mla fp8one > $OUT/ncu_$v.txt 2>&1
  echo "rc=$?" >> $T
  grep -E "fp8one|gpu__time_duration.sum |smsp__average_warps_issue_stalled_.*_per_issue_active.ratio |ERROR" $OUT/ncu_$v.txt |
    sed 's/  */ /g' | cut -c1-110 >> $T
done
step done
rm -f $OUT/b.log
cat $T
