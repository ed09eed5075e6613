#!/usr/bin/env bash
# MLA decode, FP8 pages, round 7 (session 11): the round-6 kernel (st) against its round-7 forms: =stl (the lazy
# rescale: P against each head's running maximum, the maxima exchanged only when a score passes it by 2^8),
# =stp (the tile's one wgmma wait at its top: S(it + 1) runs on under the softmax, the barrier and the PV issue),
# =stlp (both). Op tests (every wgmma FP8 variant vs the CPU op; stp bitwise st, stlp bitwise stl, the redo path
# at LUNAR_MLA_WGMMA_LAZY=0), the kernel A/B (bench_mla fp8ab, 4 rotated rounds), Kimi-Linear's FP8 decode
# step (TPOT, B = 8 / 64, 32K) in alternating rounds, then ncu (--set full, raw page) on one launch of st and
# of stlp at H = 32, B = 64, 32K while time is left.
#   P=<dir with bin/ (lunar, lunar_cuda_tests, bench_mla) and lib/> OUT=... tools/device/mla7.sh
set -u
P=${P:-.xfer-mla7}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla (stl / stp / stlp runs; stp bitwise st, stlp bitwise stl)"
LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_cuda_tests cuda_mla > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "lazy|PV in flight" $OUT/t_mla.log | grep -E "fp8|decode:" | sed 's/^ *//' | cut -c1-130 | sort | uniq -c | head -20 >> $T
step "bench_mla fp8ab (${BENCH_MLA_AB:-st stl stp stlp})"
timeout 70 $P/bin/bench_mla fp8ab > $OUT/fp8ab.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
K=configs/kimi-linear-48b-a3b.json
for round in 1 2 3; do
  for v in ${VARIANTS:-def stl stp stlp}; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-95} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
      --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s %s ms; ", $1, $3}' $OUT/b.log)" >> $T
  done
done
for v in ${NCU_VARIANTS:-st stlp}; do
  [ $(( $(date +%s) - t0 )) -gt ${NCU_BEFORE:-115} ] && { echo "skip ncu $v (time)" >> $T; continue; }
  step "ncu $v (H = 32, B = 64, 32K, one launch)"
  LUNAR_MLA_WGMMA_FP8=$v timeout 45 ncu --clock-control none --set full --page raw -k regex:wgmma_decode_st --launch-skip 1 \
    --launch-count 1 $P/bin/bench_mla fp8one > $OUT/ncu_$v.txt 2>&1; echo "rc=$?" >> $T
  grep -E "fp8one|gpu__time_duration.sum |sm__throughput.avg.pct_of_peak_sustained_elapsed |smsp__average_warps_issue_stalled_(barrier|long_scoreboard|short_scoreboard|wait|math_pipe_throttle|mio_throttle|membar|no_instruction|dispatch_stall|sleeping|selected|lg_throttle|branch_resolving|not_selected|misc|drain|tex_throttle|imc_miss)_per_issue_active.ratio " $OUT/ncu_$v.txt | sed 's/  */ /g' | cut -c1-110 >> $T
done
step done
(cd $OUT && tar czf logs.tgz t_mla.log b.log 2>/dev/null && rm -f b.log t_mla.log)
cat $T
