#!/usr/bin/env bash
# Session 16, issue 8 (branch s16-mx4): path 16's MXFP4 decode pair at one token, one device call:
# the MXFP4 experts op tests (LUNAR_MOE_F16_W bit-equal to the default, LUNAR_MOE_F16_IL against the CPU op,
# every path-16 case); the pair at one token on K3.1's layer and its TP8 slice (LUNAR_MOE_BENCH=f16ab, rounds
# alternating, each kernel's own time too) under the default, IL, W, IL + W and session 15's deciding split
# (LUNAR_MOE_F16_SKIP=1 no widening, =2 the copy ring alone; the ring alone also with IL and with W); Nsight
# Compute on K3.1's two kernels under the variant fastest on K3.1's pair; the K3.1 TP8 slice's B = 1 step,
# default vs the variant fastest on the TP8 pair, alternating; cuda_forward_k3 under that variant.
# Run (session 16, call 1) with the binaries of d24ce7f: LUNAR_MOE_F16_W is not in the tree since (measured level /
# slower: docs/benchmarks.md "MoE decode, MXFP4, at one token: the copy ring (session 16)"; git show 1d05510).
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] [MROUNDS=3] [NCU=1] [BUDGET=200] bash tools/device/mx4v16.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
B=${BUDGET:-200}
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (path 16 under IL / W at TILES 0 and 3, XS unset and 2)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 120 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E " f16 n=" $OUT/t_moe.log | grep -v 'IL=' | grep -oE 'max rel err [0-9.e+-]+' | awk '{if ($4 + 0 > m) m = $4 + 0; n++}
  END {printf "path 16 (default): %d runs vs the CPU op, max rel err %.3g\n", n, m}' >> $T
grep -E " f16 n=.* IL=1" $OUT/t_moe.log | grep -oE 'max rel err [0-9.e+-]+' | awk '{if ($4 + 0 > m) m = $4 + 0; n++}
  END {printf "path 16 IL=1: %d runs vs the CPU op, max rel err %.3g\n", n, m}' >> $T
grep -E 'FAILED|passed, |CHECK|differ|NaN' $OUT/t_moe.log | cut -c1-220 | tail -8 >> $T
Z="LUNAR_MOE_F16_IL=0,LUNAR_MOE_F16_W=0,LUNAR_MOE_F16_SKIP=0"
V=${V:-"def:$Z il:LUNAR_MOE_F16_IL=1 w:LUNAR_MOE_F16_W=1 ilw:LUNAR_MOE_F16_IL=1,LUNAR_MOE_F16_W=1 nw:LUNAR_MOE_F16_SKIP=1 co:LUNAR_MOE_F16_SKIP=2 coil:LUNAR_MOE_F16_SKIP=2,LUNAR_MOE_F16_IL=1 cow:LUNAR_MOE_F16_SKIP=2,LUNAR_MOE_F16_W=1"}
step "decode pair at one token, path 16: $V (${ROUNDS:-3} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-3} timeout 100 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
# the real variants (not the SKIP split) with the lowest mean on each shape, def excluded
best_of() { grep -E "^$1 mean " $OUT/bench.log | grep -vE ' mean (def|nw|co|coil|cow):' | sort -t: -k3 -n |
  awk -F' mean ' '{split($2, a, ":"); print a[1]; exit}'; }
bk3=$(best_of 'K3.1 \(3584, 3072\)'); btp=$(best_of 'K3.1 TP8 \(3584, 384\)')
spec() { echo "$V" | tr ' ' '\n' | grep "^$1:" | cut -d: -f2; }
bspec=$(spec "$btp")
echo "fastest variant: K3.1 pair ${bk3:-none}, TP8 pair ${btp:-none} ($bspec)" >> $T
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
NCUG='moe_decode_f16_kernel|gpu__time_duration.sum|dram__bytes_read.sum |dram__throughput.avg.pct_of_peak_sustained_elapsed|lts__throughput.avg.pct|smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|launch__registers_per_thread|launch__grid_size|launch__occupancy_limit|stalled_[a-z_]+_per_issue_active.ratio'
if [ "${NCU:-1}" = 1 ] && [ -n "$bk3" ] && ! late $((B - 110)); then
  nv="$bk3:$(spec "$bk3")"
  step "ncu: K3.1 one token, gate/up + down ($nv)"
  LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="$nv" LUNAR_MOE_BENCH_ROUNDS=1 timeout 60 \
    ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum --page raw \
    -k regex:moe_decode_f16 --launch-skip 2 --launch-count 2 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$bk3.txt 2>&1; echo "rc=$?" >> $T
  grep -E "$NCUG" $OUT/ncu_$bk3.txt | grep -v '\.max\|\.min\|\.sum\.pct' |
    sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' |
    awk '/^ ?[a-z_]+ ratio / && $NF + 0 < 0.1 {next} {print}' | cut -c1-140 >> $T
fi
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
if [ -n "$bspec" ]; then
  for r in $(seq 1 "${MROUNDS:-3}"); do
    late $((B - 30)) && break
    W="def:LUNAR_NONE=0 $btp:$bspec"; [ $((r % 2)) = 0 ] && W="$btp:$bspec def:LUNAR_NONE=0"
    for v in $W; do
      step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
      env $(echo "${v#*:}" | tr ',' ' ') timeout 40 $M > $OUT/m_${v%%:*}_$r.log 2>&1
      echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
    done
  done
  if ! late $((B - 20)); then
    step "cuda_forward_k3 under $btp"
    env $(echo "$bspec" | tr ',' ' ') OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
    grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
  fi
fi
step "table: TPOT ms, K3.1 TP8 slice B=1"
for n in def $btp; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log ncu_*.txt)
cat $T
