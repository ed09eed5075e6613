#!/usr/bin/env bash
# Session 16, issue 8 (branch s16-mx4), second call: LUNAR_MOE_F16_IL the default at one token. The MoE op
# tests (path 16 under IL / W / S8 against the CPU op and W bit-equal; cuda_moe_layer_vs_cpu, route tests),
# cuda_forward_k3 and the folded-norm bit-equality with the new default; the pair at one token
# (LUNAR_MOE_BENCH=f16ab, 5 rounds alternating) under the default (IL), IL=0, S8 (8 interleaved k-splits),
# IL at TILES=3, and the copy ring alone (SKIP=2) under IL=0 / IL / IL + W / S8; Nsight Compute on K3.1's
# kernels under S8; the K3.1 TP8 slice's B = 1 step, default (IL) vs IL=0, alternating.
# Run (session 16, call 2) with the binaries of 1d05510: LUNAR_MOE_F16_W and _S8 are not in the tree since (measured
# slower; git show 1d05510), nor f16_v16_case (now f16_il_case, IL alone).
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=5] [MROUNDS=4] [BUDGET=150] bash tools/device/mx4v16b.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
B=${BUDGET:-150}
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (path 16 under IL / W / S8), cuda_moe_layer, cuda_moe_route"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
for pat in "IL=0 W=0 S8=0" "IL=1 W=0 S8=0" "IL=0 W=1" "IL=1 W=1" "S8=1"; do
  grep -E " f16 n=.* $pat" $OUT/t_moe.log | grep -oE 'max rel err [0-9.e+-]+' | awk -v p="$pat" '{if ($4 + 0 > m) m = $4 + 0; n++}
    END {printf "path 16 %s: %d runs vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E " f16 n=" $OUT/t_moe.log | grep -vE 'IL=|XS=' | grep -oE 'max rel err [0-9.e+-]+' | awk '{if ($4 + 0 > m) m = $4 + 0; n++}
  END {printf "path 16 default (IL at one token): %d cases vs the CPU op, max rel err %.3g\n", n, m}' >> $T
grep -E 'FAILED|passed, |CHECK|differ|NaN' $OUT/t_moe.log | cut -c1-220 | tail -6 >> $T
OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_layer > $OUT/t_layer.log 2>&1; echo "rc=$? cuda_moe_layer" >> $T
grep -E 'FAILED|passed, ' $OUT/t_layer.log | cut -c1-200 | tail -3 >> $T
OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_moe_route > $OUT/t_route.log 2>&1; echo "rc=$? cuda_moe_route" >> $T
grep -E 'FAILED|passed, ' $OUT/t_route.log | cut -c1-200 | tail -3 >> $T
step "cuda_forward_k3, cuda_forward_combine (IL the default)"
OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1; echo "rc=$? cuda_forward_k3" >> $T
grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward_combine > $OUT/t_fwc.log 2>&1; echo "rc=$? cuda_forward_combine" >> $T
grep -E 'FAILED|passed, ' $OUT/t_fwc.log | cut -c1-200 | tail -3 >> $T
S=LUNAR_MOE_F16_SKIP
V=${V:-"def:$S=0 il0:LUNAR_MOE_F16_IL=0 s8:LUNAR_MOE_F16_S8=1 ilt3:LUNAR_MOE_F16_TILES=3 co0:$S=2,LUNAR_MOE_F16_IL=0 coil:$S=2 coilw:$S=2,LUNAR_MOE_F16_W=1 cos8:$S=2,LUNAR_MOE_F16_S8=1"}
step "decode pair at one token, path 16: $V (${ROUNDS:-5} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-5} timeout 100 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
NCUG='moe_decode_f16_kernel|gpu__time_duration.sum|dram__bytes_read.sum |lts__throughput.avg.pct|smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|launch__registers_per_thread |launch__grid_size|launch__occupancy_limit_(registers|shared)|stalled_[a-z_]+_per_issue_active.ratio'
if ! late $((B - 90)); then
  step "ncu: K3.1 one token, gate/up + down (s8)"
  LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="s8:LUNAR_MOE_F16_S8=1" LUNAR_MOE_BENCH_ROUNDS=1 timeout 40 \
    ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum --page raw \
    -k regex:moe_decode_f16 --launch-skip 2 --launch-count 2 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_s8.txt 2>&1; echo "rc=$?" >> $T
  grep -E "$NCUG" $OUT/ncu_s8.txt | grep -v '\.max\|\.min\|\.sum\.pct' |
    sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' |
    awk '/^ ?[a-z_]+ ratio / && $NF + 0 < 0.1 {next} {print}' | cut -c1-140 >> $T
fi
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
for r in $(seq 1 "${MROUNDS:-4}"); do
  late $((B - 14)) && break
  W="def:LUNAR_NONE=0 il0:LUNAR_MOE_F16_IL=0"; [ $((r % 2)) = 0 ] && W="il0:LUNAR_MOE_F16_IL=0 def:LUNAR_NONE=0"
  for v in $W; do
    step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
    env $(echo "${v#*:}" | tr ',' ' ') timeout 30 $M > $OUT/m_${v%%:*}_$r.log 2>&1
    echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
  done
done
step "table: TPOT ms, K3.1 TP8 slice B=1"
for n in def il0; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log ncu_*.txt)
cat $T
