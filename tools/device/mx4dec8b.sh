#!/usr/bin/env bash
# Issue 8/9, session 8, call 2 (branch s8-mx4dec2): Nsight Compute on the BF16 decode pair at batch 1
# (Kimi-Linear's shape in LUNAR_MOE_BENCH=decode1) with session 7's kernels (LUNAR_MOE_DEC_OPT=0),
# the new default and the gate/up kernel at 2 k-splits (LUNAR_MOE_DEC_SPLIT=2), then the decode
# bench and lunar bench Kimi-Linear B=1,8 default vs SPLIT=2, two rounds alternating.
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec8b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec8b.txt . tools/device/env.sh
NCU="ncu --clock-control none --kernel-name-base demangled --section SpeedOfLight --section LaunchStats --section Occupancy --metrics smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__warps_active.avg.pct_of_peak_sustained_active"
for e in LUNAR_MOE_DEC_OPT=0 LUNAR_NONE=0 LUNAR_MOE_DEC_SPLIT=2; do
  step "ncu BF16 pair at batch 1, $e"
  env $e LUNAR_MOE_BENCH=decode1 timeout 40 $NCU -k regex:'moe_decode_kernel<.int.1, .bool.0' --launch-count 2 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_${e#LUNAR_}.txt 2>&1; echo "rc=$?" >> $T
  grep -E 'moe_decode_kernel<|Duration|DRAM Through|Grid Size|Registers Per|Waves Per SM|Achieved Occ|inst_executed|stalled|dram__bytes|warps_active' $OUT/ncu_${e#LUNAR_}.txt | head -30 >> $T
done
step "decode1 bench LUNAR_MOE_DEC_SPLIT=2"
LUNAR_MOE_DEC_SPLIT=2 LUNAR_MOE_BENCH=decode1 timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_s2.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| [KM]|Measured' $OUT/bench_s2.log >> $T
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K=configs/kimi-linear-48b-a3b.json
for r in 1 2; do for e in LUNAR_NONE=0 LUNAR_MOE_DEC_SPLIT=2; do
  step "KL48 B=1,8 $e round $r"
  env $e timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
    --batch-sizes 1,8 --contexts 1024 --steps 64 > $OUT/kl_${e#LUNAR_}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/kl_${e#LUNAR_}_$r.log)" >> $T
done; done
step "op tests with LUNAR_MOE_DEC_SPLIT=2"
LUNAR_MOE_DEC_SPLIT=2 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_experts > $OUT/t_moe_s2.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe_s2.log | cut -c1-200 | tail -6 >> $T
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec8b.txt -- * && rm -f t_* kl_* bench_* ncu_*)
cat $T
