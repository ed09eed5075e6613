#!/usr/bin/env bash
# Session 9, issues 8/9 (branch s9-moemc): MoE prefill path 17 (LUNAR_MOE_PREFILL=wsmc: path 12's BF16
# kernel in clusters of 2 CTAs, an expert's M tile pairs sharing each weight chunk by TMA multicast,
# the odd last tiles paired without) in one device call: the BF16 experts op tests (every path vs the
# CPU op, 17 among them), the prefill kernel table (LUNAR_MOE_BENCH=prefill-bf16: paths 12 / 7 / 17 /
# 12 / 17 on Kimi-Linear's shape), then the Kimi-Linear 8K prefill, default (path 12) vs wsmc in
# alternating rounds with --profile, and (time left) the forward tests under wsmc.
# Call 2 adds CL=<clusters> (LUNAR_MOE_WSMC_CLUSTERS, the persistent grid's cluster count instead of
# the occupancy query's) to the table and the A/B, and NCU=1: Nsight Compute on path 12's and path
# 17's first gate/up launch of the table (launch, speed of light, warp stalls).
# From the next call on (not run in session 9): path 18 (LUNAR_MOE_PREFILL=wsmc2, path 17 with
# CTA-scope remote releases) in the op tests, the table, the A/B (V2=0 leaves it out) and ncu.
#   P=<prebuilt dir> OUT=<dir> [AB_S=s: no round started after s seconds] [CL=66] [NCU=1] tools/device/moemc.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moemc.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
K=configs/kimi-linear-48b-a3b.json
nvidia-smi -L >> $T
for c in 0 ${CL:-}; do
  step "op tests: cuda_moe_experts_bf16 (path 17 = wsmc among the others, vs the CPU op), LUNAR_MOE_WSMC_CLUSTERS=$c"
  LUNAR_MOE_WSMC_CLUSTERS=$c LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 50 $P/bin/lunar_tests cuda_moe_experts_bf16 > $OUT/t_moe_$c.log 2>&1; echo "rc=$?" >> $T
  grep -E ' wsmc2? |FAILED|passed, |CHECK|path 17' $OUT/t_moe_$c.log | cut -c1-160 | tail -${TL:-40} >> $T
  # a hung kernel (a barrier protocol error) would hang every later step too
  if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe_$c.log >> $T; cat $T; exit 1; fi
  TL=4
done
for c in 0 ${CL:-}; do
  step "prefill kernel table (LUNAR_MOE_BENCH=prefill-bf16), LUNAR_MOE_WSMC_CLUSTERS=$c"
  LUNAR_MOE_WSMC_CLUSTERS=$c LUNAR_MOE_BENCH=prefill-bf16 timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_$c.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| prefill|Measured|path 17' $OUT/bench_$c.log | grep -v 'mma.sync\|wgmma (4)\|pfence' | cut -c1-110 >> $T
done
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(experts|moe|kda_core|attn)$/ {printf "%s %s; ", $1, $2}' "$1"; }
bench() { # name, env
  env $2 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
    --batch-sizes 1 --contexts 1024 --steps 1 --profile > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
for r in 1 2 3; do
  late ${AB_S:-100} && break
  step "Kimi-Linear 8K prefill A/B round $r"
  V="def:LUNAR_NONE=0 wsmc:LUNAR_MOE_PREFILL=wsmc"
  [ "${V2:-1}" = 1 ] && V="$V wsmc2:LUNAR_MOE_PREFILL=wsmc2"
  [ -n "${CL:-}" ] && V="$V wsmc$CL:LUNAR_MOE_PREFILL=wsmc,LUNAR_MOE_WSMC_CLUSTERS=$CL"
  [ $r = 2 ] && V=$(echo $V | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $V; do e=${v#*:}; bench ${v%%:*}_$r "${e//,/ }"; done
done
! late ${FWD_S:-150} && { step "LUNAR_MOE_PREFILL=wsmc lunar_tests cuda_forward"
  LUNAR_MOE_PREFILL=wsmc OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -6 >> $T; }
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  for k in 0 2 3; do  # CL template argument: 0 path 12, 2 path 17, 3 path 18 (gate/up: GATEUP true, PF 3)
    late ${NCU_S:-170} && break
    step "ncu moe_ws_kernel<bf16, gate/up, CL=$k, PF=3> (first launch, Kimi-Linear swiglu)"
    LUNAR_MOE_BENCH=prefill-bf16 timeout 45 ncu --clock-control none --kernel-name-base mangled \
      -k regex:moe_ws_kernelILb0ELb1ELi${k}ELi3E -c 1 --section LaunchStats --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$k.txt 2>&1
    echo "rc=$?" >> $T
    grep -E 'Duration|Throughput|Grid Size|Cluster|Waves|Registers|Achieved Occ|Warp Cycles|Issued Ipc|Hit Rate' $OUT/ncu_$k.txt | tr -s ' ' | cut -c1-110 | head -24 >> $T
    grep -E 'issue_stalled' $OUT/ncu_$k.txt | awk '$NF + 0 >= 0.1' | sed 's/smsp__average_warps_issue_stalled_//' | tr -s ' ' | cut -c1-90 >> $T
  done
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moemc.txt -- * && rm -f b_*.log t_fwd.log ncu_*.txt t_moe_*.log)  # 8 files come back
cat $T
