#!/usr/bin/env bash
# Session 15, issue 8, second call: where path 16's time goes at one token, by leaving parts out
# (LUNAR_MOE_F16_SKIP, WRONG results, benchmark only): 1 = no widening (the raw words into the mma),
# 2 = the copy ring alone (each chunk waited for and its stage refilled), the latter also at one row
# group a block (TILES=0) and at 6 (one wave at K3.1's gate/up); LUNAR_MOE_BENCH=f16ab, alternating
# rounds; then Nsight Compute on the copy ring alone (K3.1's gate/up and down).
# Not run in session 15 (the session's device budget); needs the binaries of 167f51f (LUNAR_MOE_F16_SKIP,
# not in the tree since).
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] bash tools/device/mx4dec15b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi -L >> $T
V="def:LUNAR_MOE_F16_SKIP=0,LUNAR_MOE_F16_TILES=1 nw:LUNAR_MOE_F16_SKIP=1 co:LUNAR_MOE_F16_SKIP=2 co_t0:LUNAR_MOE_F16_SKIP=2,LUNAR_MOE_F16_TILES=0 co_t6:LUNAR_MOE_F16_SKIP=2,LUNAR_MOE_F16_TILES=6"
step "decode pair at one token, path 16, parts left out: $V"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-3} timeout 60 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|Measured|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis"
NCUG='moe_decode_f16_kernel|gpu__time_duration.sum|dram__bytes_read.sum|gpu__dram_throughput.avg.pct|lts__throughput.avg.pct|lts__t_sector_hit_rate|smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|sm__cycles_active.avg |stalled_(long_scoreboard|barrier|wait|math_pipe_throttle|not_selected|short_scoreboard)_per_issue_active.ratio'
step "ncu: K3.1 one token, the copy ring alone (co), gate/up + down"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="co:LUNAR_MOE_F16_SKIP=2" LUNAR_MOE_BENCH_ROUNDS=1 timeout 60 \
  ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum --page raw \
  -k regex:moe_decode_f16 --launch-skip 2 --launch-count 2 \
  $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_co.txt 2>&1; echo "rc=$?" >> $T
grep -E "$NCUG" $OUT/ncu_co.txt | grep -v '\.max\|\.min\|\.sum\.pct' | sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | cut -c1-140 >> $T
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f ncu_*.txt)
cat $T
