#!/usr/bin/env bash
# Session 15, issue 8 (branch s15-mx4dec): path 16's MXFP4 decode pair at batch 1, one device call:
# the MXFP4 experts op tests (LUNAR_MOE_F16_LA / _DEEP / _ONE bit-equal to all off, every path-16 case),
# the pair at one token on K3.1's layer and its TP8 slice under def / LA / DEEP / ONE / all three /
# TDN=3 in alternating rounds (LUNAR_MOE_BENCH=f16ab: each kernel's own time too), Nsight Compute on
# K3.1's gate/up and down kernels (default, then all three: warp states, issue, DRAM, occupancy), the
# K3.1 TP8 slice's B = 1 step default vs the variant fastest on the TP8 pair, alternating, and
# cuda_forward_k3 under it.
# Run (session 15) with the binaries of cfad2a9 (the variants' code, not in the tree since: measured
# slower, docs/benchmarks.md "MoE decode, MXFP4, at one token: where the time goes (session 15)").
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] [MROUNDS=3] [NCU=1] bash tools/device/mx4dec15.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (path 16 under LA / DEEP among every path)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E " f16 n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++}
  END {printf "path 16: %d cases vs the CPU op, max rel err %.3g\n", n, m}' >> $T
grep -E 'FAILED|passed, |CHECK|differ' $OUT/t_moe.log | cut -c1-200 | tail -8 >> $T
A="LUNAR_MOE_F16_LA=1,LUNAR_MOE_F16_DEEP=1,LUNAR_MOE_F16_ONE=1"
V=${V:-"def:LUNAR_MOE_F16_LA=0,LUNAR_MOE_F16_DEEP=0,LUNAR_MOE_F16_ONE=0,LUNAR_MOE_F16_TDN=0 la:LUNAR_MOE_F16_LA=1 deep:LUNAR_MOE_F16_DEEP=1 one:LUNAR_MOE_F16_ONE=1 all:$A tdn3:LUNAR_MOE_F16_TDN=3"}
step "decode pair at one token, path 16: $V (${ROUNDS:-3} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-3} timeout 60 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|Measured|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' >> $T
# the variant with the lowest TP8 mean (the model's shape), def excluded
best=$(grep -E '^K3.1 TP8 .* mean ' $OUT/bench.log | grep -v ' mean def:' | sort -t: -k3 -n |
  awk -F' mean ' '{split($2, a, ":"); print a[1]; exit}')
bspec=$(echo "$V" | tr ' ' '\n' | grep "^$best:" | cut -d: -f2)
echo "fastest variant on the TP8 pair: ${best:-none} ($bspec)" >> $T
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
NCUG='moe_decode_f16_kernel|gpu__time_duration.sum|dram__bytes_read.sum|dram__throughput.avg.pct_of_peak_sustained_elapsed|smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|launch__registers_per_thread|launch__grid_size|launch__occupancy_limit|smsp__warps_eligible.avg.per_cycle|stalled_[a-z_]+_per_issue_active.ratio|ldgsts.*sum '
if [ "${NCU:-1}" = 1 ]; then
  for nv in "def:LUNAR_MOE_F16_LA=0" "all:$A"; do
    late 100 && break
    step "ncu: K3.1 one token, gate/up + down (${nv%%:*})"
    LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="$nv" LUNAR_MOE_BENCH_ROUNDS=1 timeout 70 \
      ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum --page raw \
      -k regex:moe_decode_f16 --launch-skip 2 --launch-count 2 \
      $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_${nv%%:*}.txt 2>&1; echo "rc=$?" >> $T
    grep -E "$NCUG" $OUT/ncu_${nv%%:*}.txt | sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' |
      awk '/^ ?[a-z_]+ ratio / && $NF + 0 < 0.1 {next} {print}' | cut -c1-140 >> $T
  done
fi
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
if [ -n "$bspec" ]; then
  for r in $(seq 1 "${MROUNDS:-3}"); do
    late 175 && break
    W="def:LUNAR_NONE=0 $best:$bspec"; [ $((r % 2)) = 0 ] && W="$best:$bspec def:LUNAR_NONE=0"
    for v in $W; do
      step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
      env $(echo "${v#*:}" | tr ',' ' ') timeout 40 $M > $OUT/m_${v%%:*}_$r.log 2>&1
      echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
    done
  done
  if ! late 180; then
    step "cuda_forward_k3 under $best"
    env $(echo "$bspec" | tr ',' ' ') OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
    grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
  fi
fi
step "table: TPOT ms, K3.1 TP8 slice B=1"
for n in def $best; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log ncu_*.txt)
cat $T
