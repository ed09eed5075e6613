#!/usr/bin/env bash
# Session 7, final call (one H200): main after every merge. check.sh tests, the model-level CUDA tests with the
# session's new defaults (warp router, float4 RMSNorm, MXFP4 prefill path 13, ...), issue 9's table (Kimi-Linear-48B
# and the K3.1 TP8 slice), A/B rounds of the new defaults against their switches, llama.cpp as the peer
# (LLAMA=<llama-bench>: tools/device/peer_llamacpp.sh) and (NCU=1) the per-kernel table of one Kimi-Linear B=1 step.
#   P=<prebuilt dir> [SKIP_CHECK=1] [SKIP_TABLES=1] [LLAMA=<llama-bench>] [NCU=1] [AB="ENV=V ..."] [AB_BATCH=1,32,64] \
#     [TESTS="cuda_forward ..."] [PF_AB="ENV=V ..."] [SKIP_AB=1] tools/device/session7_final.sh
# PF_AB: the 8K prefill (Kimi-Linear, and the K3.1 slice) of main's defaults against each variant, two rounds.
set -u
P=${P:-.xfer-fin7}
OUT=${OUT:-/tmp/o}
SUMMARY=final.txt . tools/device/env.sh
# the power limits and clocks (session 8: an 8K prefill ran power-capped, SM clock 1635-1965 MHz)
timeout 20 nvidia-smi -q -d POWER,CLOCK > $OUT/power.txt 2>&1
grep -E 'Power Limit|Power Draw|^ +SM +:' $OUT/power.txt | head -8 >> $T
if [ "${SKIP_CHECK:-0}" != 1 ]; then
step "check.sh tests"
TESTS=cuda SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=120 ENGINE_TIMEOUT=45 OUT=$OUT/check timeout 200 tools/device/check.sh tests > $OUT/check.log 2>&1
echo "check.sh rc=$?" >> $T; cat $OUT/check/table.txt >> $T 2>/dev/null
fi
for f in ${TESTS:-cuda_forward cuda_moe_ cuda_mla cuda_kda cuda_matmul cuda_add_rmsnorm cuda_norms}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
K=configs/kimi-linear-48b-a3b.json
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
if [ "${SKIP_TABLES:-0}" != 1 ]; then
step "KL48 table"
timeout 150 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 36864 --input-lens 1024,8192,32768 \
  --batch-sizes 1,8,32,64 --contexts 1024 > $OUT/kl_table.log 2>&1
echo "rc=$?" >> $T; grep -A12 '^prefill' $OUT/kl_table.log | head -5 >> $T; tpot $OUT/kl_table.log >> $T
step "K3.1 slice table"
timeout 120 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1,8,64 \
  --contexts 8192 > $OUT/k3_table.log 2>&1
echo "rc=$?" >> $T; grep -A4 '^prefill' $OUT/k3_table.log | head -3 >> $T; tpot $OUT/k3_table.log >> $T; grep -i 'project' $OUT/k3_table.log | head -3 >> $T
fi
# AB: variants separated by spaces, the assignments of one variant by commas (LUNAR_ROUTER=block,LUNAR_NORM=block);
# SKIP_AB=1 skips the decode rounds (binab.sh times main's B=1 instead)
for r in $([ "${SKIP_AB:-0}" = 1 ] || echo 1 2); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-}; do
    i=$((i + 1))
    step "KL48 decode B=${AB_BATCH:-1} $v round $r"
    env ${v//,/ } timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes ${AB_BATCH:-1} --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
if [ -n "${PF_AB:-}" ]; then
  for r in 1 2; do
    i=0
    for v in LUNAR_NONE=0 $PF_AB; do
      i=$((i + 1))
      step "KL48 prefill 8K $v round $r"
      env ${v//,/ } timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
        --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/pf_${i}_$r.log 2>&1
      echo "rc=$? $(grep -A3 '^prefill' $OUT/pf_${i}_$r.log | awk '$1 ~ /^[0-9]+$/ {print $0}' | tr -s ' ' | head -1)" >> $T
    done
  done
fi
if [ -n "${LLAMA:-}" ]; then
  step "llama.cpp peer (Kimi-Linear-48B, random Q4_0 GGUF)"
  LLAMA_BENCH=$LLAMA OUT=$OUT timeout 560 tools/device/peer_llamacpp.sh > $OUT/llamacpp.log 2>&1
  echo "rc=$?" >> $T; grep -E 'gguf rc|^\|' $OUT/llamacpp.log | head -12 >> $T
fi
if [ "${NCU:-0}" = 1 ]; then
  step "ncu: one KL48 B=1 decode step, per kernel"
  timeout 100 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-count 3000 \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 1024 --steps 1 \
    > $OUT/ncu_dec.csv 2> $OUT/ncu_dec.err
  echo "ncu rc=$?" >> $T; gzip $OUT/ncu_dec.csv; python3 tools/device/ncu_step.py $OUT/ncu_dec.csv.gz -3 > $OUT/ncu_table.md 2>&1
  head -16 $OUT/ncu_table.md >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=final.txt --exclude='ncu_dec.csv.gz' -- * && rm -rf check t_* ab_* pf_* kl_* k3_* ncu_dec.err llamacpp.log)
cat $T
