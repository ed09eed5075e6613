#!/usr/bin/env bash
# Session 11's last call (one H200): main after the session's merges, most important first.
#  1. lunar_tests for $TESTS (default: the suites this session touched)
#  2. the K3.1 TP8 slice's B = 1 step (10 layers, 8K context), main's defaults against each variant of $K3AB
#     (space-separated; a variant's assignments comma-separated), $ROUNDS rounds alternating
#  3. issue 9's tables: Kimi-Linear-48B (prefill 1K/8K/32K, decode B = 1/8/32/64) and the K3.1 slice projected to 93
#  4. NCU=1: the route and AttnRes kernels (NCU_K: another kernel-name regex) of one eager K3.1 slice step under Nsight Compute (each kernel alone)
#  5. LLAMA=<llama-bench>: llama.cpp's Kimi-Linear as issue 9's peer (tools/device/peer_llamacpp.sh)
#   P=<prebuilt dir> OUT=<dir> [TESTS=...] [K3AB=...] [ROUNDS=3] [NCU=1] [LLAMA=...] tools/device/session11_final.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=final.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10"
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
timeout 20 nvidia-smi -q -d POWER,CLOCK > $OUT/power.txt 2>&1
for f in ${TESTS:-cuda_attnres cuda_moe_ cuda_forward}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${K3AB:-}; do
    i=$((i + 1))
    step "K3.1 slice B=1 ctx 8K $v round $r"
    env ${v//,/ } timeout 60 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 \
      --contexts 8192 --steps 64 > $OUT/k3ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/k3ab_${i}_$r.log)" >> $T
  done
done
step "KL48 table"
timeout 150 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 36864 --input-lens 1024,8192,32768 \
  --batch-sizes 1,8,32,64 --contexts 1024 > $OUT/kl_table.log 2>&1
echo "rc=$?" >> $T; grep -A4 '^prefill' $OUT/kl_table.log | head -5 >> $T; tpot $OUT/kl_table.log >> $T
step "K3.1 slice table"
timeout 120 $P/bin/lunar bench $S --project-layers 93 --load-format dummy --backend cuda --input-lens 8192 \
  --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_table.log 2>&1
echo "rc=$?" >> $T; grep -A3 '^prefill' $OUT/k3_table.log | head -3 >> $T; grep -A5 '^decode' $OUT/k3_table.log | head -5 >> $T
if [ "${NCU:-0}" = 1 ]; then
  step "ncu: route and AttnRes kernels, one K3.1 slice B=1 step"
  timeout 90 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    -k regex:"${NCU_K:-router_warp|attnres|embedding}" --launch-count 400 \
    $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 8192 --steps 1 \
    > $OUT/ncu_ra.csv 2> $OUT/ncu_ra.err
  echo "ncu rc=$?" >> $T; python3 tools/device/ncu_step.py $OUT/ncu_ra.csv -3 > $OUT/ncu_ra.md 2>&1; head -12 $OUT/ncu_ra.md >> $T
fi
if [ -n "${LLAMA:-}" ]; then
  step "llama.cpp peer (Kimi-Linear-48B, random Q4_0 GGUF)"
  LLAMA_BENCH=$LLAMA OUT=$OUT timeout ${LLAMA_TIMEOUT:-300} tools/device/peer_llamacpp.sh > $OUT/llamacpp.log 2>&1
  echo "rc=$?" >> $T; grep -E 'gguf rc|^\||llama-bench rc' $OUT/llamacpp.log | head -14 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=final.txt -- * && rm -rf t_* k3ab_* kl_* k3_* ncu_ra.* llamacpp.log)
cat $T
