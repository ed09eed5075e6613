#!/usr/bin/env bash
# Session 17, issue 8, the lead's first call: the split that decides whether a producer warp can help the MXFP4
# decode pair at one token. LUNAR_MOE_F16_SKIP=3 (the consumers alone, no weight copies; in git show 4c5f183, built
# from main + that commit) beside SKIP=2 (the copy ring alone) and the default (IL), K3.1 and the TP8 slice, rounds
# alternating; then Nsight Compute of the consumers alone on K3.1 (gate/up, down).
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=4] bash tools/device/s17_skip3.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader >> $T
S=LUNAR_MOE_F16_SKIP
V="def:$S=0 co:$S=2 cs:$S=3"
step "decode pair at one token, path 16: $V (${ROUNDS:-4} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-4} timeout 100 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats"
NCUG='moe_decode_f16_kernel|gpu__time_duration.sum|dram__bytes_read.sum |smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|launch__registers_per_thread |launch__grid_size|stalled_[a-z_]+_per_issue_active.ratio'
for v in cs def; do
  step "ncu: K3.1 one token, gate/up + down ($v)"
  sk=0; [ $v = cs ] && sk=3
  LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="$v:$S=$sk" LUNAR_MOE_BENCH_ROUNDS=1 timeout 60 \
    ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum --page raw \
    -k regex:moe_decode_f16 --launch-skip 2 --launch-count 2 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$v.txt 2>&1; echo "rc=$?" >> $T
  grep -E "$NCUG" $OUT/ncu_$v.txt | grep -v '\.max\|\.min\|\.sum\.pct' |
    sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' |
    awk '/^ ?[a-z_]+ ratio / && $NF + 0 < 0.1 {next} {print}' | cut -c1-140 >> $T
done
step "done"
cat $T
