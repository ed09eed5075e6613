#!/usr/bin/env bash
# Session 17, issue 8 (branch s17-mx4p): LUNAR_MOE_F16_FUSED, path 16 at one token as one persistent kernel fed
# by bulk copies (cuda_moe_f16p.cu). The MoE op tests (f16_fused_case: the kernel with 8 / 4 / 16 consumer warps
# vs the CPU op, twice in a row, in a replayed CUDA graph), cuda_moe_layer and cuda_forward_k3 with and without
# the switch, the K3 graphs with it; the pair at one token (LUNAR_MOE_BENCH=f16ab, ROUNDS rounds alternating)
# default vs FUSED=1 / 4 / 16 and the copy ring alone (SKIP=2); the K3.1 TP8 slice's B = 1 step, default vs the
# fastest FUSED variant on the TP8 pair, alternating; Nsight Compute of the fused kernel on K3.1 if time is left.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=4] [MROUNDS=3] [BUDGET=320] bash tools/device/mx4p17.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
B=${BUDGET:-320}
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (FUSED=1/4/16 vs the CPU op, twice, graph replays)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
rc=$?; echo "rc=$rc" >> $T
# a hang (the persistent kernel's waits) or a crash: no further FUSED step (each would wait out its timeout)
FOK=1; { [ $rc = 124 ] || [ $rc -ge 128 ]; } && FOK=0 && echo "FUSED steps skipped (rc $rc)" >> $T
tail -c 600 $OUT/t_moe.log | tr '\n' ' ' | cut -c1-600 >> $T; echo >> $T
grep -m1 'LUNAR_MOE_F16_FUSED:' $OUT/t_moe.log >> $T
for f in 1 4 16 "1 LW=0"; do
  grep -E " FUSED=$f run" $OUT/t_moe.log | grep -oE 'max rel err [0-9.e+-]+' | awk -v f="$f" '{if ($4 + 0 > m) m = $4 + 0; n++}
    END {printf "FUSED=%s: %d runs vs the CPU op, max rel err %.3g\n", f, n, m}' >> $T
done
grep -E " f16 n=" $OUT/t_moe.log | grep -vE 'IL=|XS=|FUSED=|TILES=|EARLY=' | grep -oE 'max rel err [0-9.e+-]+' |
  awk '{if ($4 + 0 > m) m = $4 + 0; n++} END {printf "path 16 default: %d cases vs the CPU op, max rel err %.3g\n", n, m}' >> $T
grep -E 'FAILED|passed, |CHECK|differ|NaN|capture' $OUT/t_moe.log | cut -c1-220 | tail -8 >> $T
step "cuda_moe_layer, cuda_forward_k3 (default, FUSED=1), cuda_forward_graphs_k3 (FUSED=1)"
FS_LIST="0"; [ $FOK = 1 ] && FS_LIST="0 1"
for f in $FS_LIST; do
  LUNAR_MOE_F16_FUSED=$f OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_layer > $OUT/t_layer$f.log 2>&1
  echo "rc=$? cuda_moe_layer FUSED=$f" >> $T
  grep -E 'FAILED|passed, ' $OUT/t_layer$f.log | cut -c1-200 | tail -3 >> $T
  LUNAR_MOE_F16_FUSED=$f OMP_NUM_THREADS=16 timeout 50 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd$f.log 2>&1
  echo "rc=$? cuda_forward_k3 FUSED=$f" >> $T
  grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd$f.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
done
for t in $([ $FOK = 1 ] && echo cuda_forward_graphs_k3 cuda_forward_graphs_pdl); do
  LUNAR_MOE_F16_FUSED=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $t > $OUT/t_$t.log 2>&1
  echo "rc=$? $t FUSED=1" >> $T
  grep -E 'LUNAR_MOE_F16_FUSED:|FAILED|passed, |CHECK' $OUT/t_$t.log | cut -c1-200 | tail -4 >> $T
done
grep -m1 'LUNAR_MOE_F16_FUSED:' $OUT/t_fwd1.log | sed 's/^/cuda_forward_k3: /' >> $T
[ $FOK = 1 ] || V="def:LUNAR_NONE=0 co:LUNAR_MOE_F16_SKIP=2"
V=${V:-"def:LUNAR_NONE=0 fu:LUNAR_MOE_F16_FUSED=1 fu4:LUNAR_MOE_F16_FUSED=4 fu16:LUNAR_MOE_F16_FUSED=16 fub:LUNAR_MOE_F16_FUSED=1,LUNAR_MOE_F16_FUSED_LW=0 co:LUNAR_MOE_F16_SKIP=2"}
step "decode pair at one token: $V (${ROUNDS:-4} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-4} timeout 120 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
# the FUSED variant (8 / 4 / 16 consumer warps) with the lowest TP8 mean runs the TPOT A/B
FV=$(grep -E '^K3.1 TP8 .* mean fu[0-9]*:' $OUT/bench.log | sed -E 's/.* mean (fu[0-9]*):[^ ]* ([0-9.]+) us.*/\2 \1/' | sort -n |
  head -1 | awk '{print $2}')
case "$FV" in fu4) FS=4 ;; fu16) FS=16 ;; *) FS=1 ;; esac
echo "TPOT variant: FUSED=$FS (${FV:-none found})" >> $T
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
for r in $(seq 1 $([ $FOK = 1 ] && echo "${MROUNDS:-3}" || echo 0)); do
  late $((B - 30)) && break
  W="def:LUNAR_NONE=0 fu:LUNAR_MOE_F16_FUSED=$FS"; [ $((r % 2)) = 0 ] && W="fu:LUNAR_MOE_F16_FUSED=$FS def:LUNAR_NONE=0"
  for v in $W; do
    step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
    env $(echo "${v#*:}" | tr ',' ' ') timeout 30 $M > $OUT/m_${v%%:*}_$r.log 2>&1
    echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
  done
done
NCUS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
NCUG='moe_f16_fused_kernel|gpu__time_duration.sum|dram__bytes_read.sum |lts__throughput.avg.pct|smsp__inst_executed.sum |smsp__issue_active.avg.pct|sm__warps_active.avg.pct|launch__registers_per_thread |launch__grid_size|launch__occupancy_limit_(registers|shared)|stalled_[a-z_]+_per_issue_active.ratio|l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum '
if [ $FOK = 1 ] && ! late $((B - 40)); then
  step "ncu: K3.1 one token, the fused kernel (FUSED=$FS)"
  LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_SHAPES=k3 LUNAR_MOE_BENCH_V="fu:LUNAR_MOE_F16_FUSED=$FS" LUNAR_MOE_BENCH_ROUNDS=1 timeout 35 \
    ncu --clock-control none $NCUS --metrics dram__bytes_read.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum --page raw \
    -k regex:moe_f16_fused --launch-skip 2 --launch-count 1 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_fu.txt 2>&1; echo "rc=$?" >> $T
  grep -E "$NCUG" $OUT/ncu_fu.txt | grep -v '\.max\|\.min\|\.sum\.pct' |
    sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' |
    awk '/^ ?[a-z_]+ ratio / && $NF + 0 < 0.1 {next} {print}' | cut -c1-140 >> $T
fi
step "table: TPOT ms, K3.1 TP8 slice B=1 (def: main's default; fu: FUSED=$FS)"
for n in def fu; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step "table: the pair at one token, means (us)"
grep -E 'mean ' $OUT/bench.log | sed -E 's/LUNAR_MOE_F16_//g' >> $T
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log ncu_*.txt bench.log)
cat $T
