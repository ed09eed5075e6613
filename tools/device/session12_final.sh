#!/usr/bin/env bash
# Session 12's last call (one H200): main after the session's merges, most important first.
#  1. CHECK=1: check.sh tests (every CUDA op against its CPU op, the goldens end to end, engine, generate, serve):
#     issue 7's and 8's verification table (needs build-device/{lunar_cuda_tests,bench_cuda,bench_mla} carried)
#  2. lunar_tests for $TESTS
#  3. A/B rounds, main's defaults against each variant (space-separated; a variant's assignments comma-separated),
#     $ROUNDS rounds alternating: K3AB on the K3.1 TP8 slice's B = 1 step (10 layers, 8K context; K3B other
#     batch sizes, K3IN an input length whose prefill is timed too), KLAB on
#     Kimi-Linear-48B's B = 1 step (1K context), PFAB on Kimi-Linear-48B's 8K prefill
#  4. issue 9's tables (MFU against the peak measured in the same call; sheet% = against the 989.4 TF data sheet):
#     Kimi-Linear-48B (prefill 1K/8K/32K, decode B = 1/8/32/64) and the K3.1 slice projected to 93 layers, decode
#     over TSTEPS (64) steps: session 11's tables ran 8 and read B = 1 0.1-0.2 ms above the 64-step A/B rounds
#   P=<prebuilt dir> OUT=<dir> [CHECK=1] [TESTS=...] [K3AB=...] [K3B=1] [K3IN=16] [KLAB=...] [PFAB=...] [ROUNDS=3] [TABLES=1]
#     tools/device/session12_final.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=final.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10"
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
pre() { awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6, $7}' "$1" | tr '\n' ' '; echo; }
timeout 20 nvidia-smi -q -d POWER,CLOCK > $OUT/power.txt 2>&1
if [ "${CHECK:-1}" = 1 ]; then
  step "check.sh tests"
  TESTS=cuda SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=150 ENGINE_TIMEOUT=45 OUT=$OUT/check timeout 260 \
    tools/device/check.sh tests > $OUT/check.log 2>&1
  echo "check.sh rc=$?" >> $T; cat $OUT/check/table.txt >> $T 2>/dev/null
fi
for f in ${TESTS:-}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in ${K3AB:+LUNAR_NONE=0 $K3AB}; do
    i=$((i + 1))
    step "K3.1 slice B=1 ctx 8K $v round $r"
    env ${v//,/ } timeout 60 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens ${K3IN:-16} \
      --batch-sizes ${K3B:-1} --contexts 8192 --steps 64 > $OUT/k3ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/k3ab_${i}_$r.log) $([ "${K3IN:-16}" = 16 ] || pre $OUT/k3ab_${i}_$r.log)" >> $T
  done
  i=0
  for v in ${KLAB:+LUNAR_NONE=0 $KLAB}; do
    i=$((i + 1))
    step "KL48 B=1 ctx 1K $v round $r"
    env ${v//,/ } timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 \
      --contexts 1024 --steps 64 > $OUT/klab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/klab_${i}_$r.log)" >> $T
  done
  i=0
  for v in ${PFAB:+LUNAR_NONE=0 $PFAB}; do
    i=$((i + 1))
    step "KL48 prefill 8K $v round $r"
    env ${v//,/ } timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 --input-lens 8192 \
      --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/pfab_${i}_$r.log 2>&1
    echo "rc=$? $(pre $OUT/pfab_${i}_$r.log)" >> $T
  done
done
if [ "${TABLES:-1}" = 1 ]; then
  step "KL48 table"
  timeout 150 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 36864 --input-lens 1024,8192,32768 \
    --batch-sizes 1,8,32,64 --contexts 1024 --steps ${TSTEPS:-64} > $OUT/kl_table.log 2>&1
  echo "rc=$?" >> $T; grep -E '^bandwidth' $OUT/kl_table.log >> $T; grep -A4 '^prefill' $OUT/kl_table.log | head -5 >> $T
  tpot $OUT/kl_table.log >> $T
  step "K3.1 slice table"
  timeout 120 $P/bin/lunar bench $S --project-layers 93 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8,64 --contexts 8192 --steps ${TSTEPS:-64} > $OUT/k3_table.log 2>&1
  echo "rc=$?" >> $T; grep -A3 '^prefill' $OUT/k3_table.log | head -3 >> $T; grep -A5 '^decode' $OUT/k3_table.log | head -5 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=final.txt -- * && rm -rf t_* k3ab_* klab_* pfab_* kl_* k3_*)
cat $T
