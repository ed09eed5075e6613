#!/usr/bin/env bash
# Session 7, last call (one H200): main after the second wave. The model-level CUDA tests (cuda_forward now runs
# the fused KDA prefill end to end), check.sh tests, Kimi-Linear decode at B = 1 / 8 / 32 / 64 and the 8K / 32K
# prefill, then A/B rounds: the session's router + vector norm against the old kernels at B = 32 / 64 (the first
# wave's table had them 1.4-2.4 % above session 6), the switches of the second wave (ROUTE_AB: variants for B = 1;
# LUNAR_KDA_CONV_ASYNC / LUNAR_KDA_PREFILL=bf16 at 8K prefill).
#   P=<prebuilt dir> [ROUTE_AB="ENV=V,..."] tools/device/session7_end.sh
set -u
P=${P:-.xfer-end}
OUT=${OUT:-/tmp/o}
SUMMARY=final.txt . tools/device/env.sh
for f in cuda_forward cuda_kda cuda_moe_ cuda_matmul; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|wide 4' $OUT/t_$f.log | cut -c1-200 | tail -6 >> $T
done
if [ -n "${ROUTE_AB:-}" ]; then
  step "$ROUTE_AB lunar_tests cuda_forward"
  env ${ROUTE_AB//,/ } OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests cuda_forward > $OUT/t_route_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_route_fwd.log | cut -c1-200 | tail -4 >> $T
fi
step "check.sh tests"
SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=120 ENGINE_TIMEOUT=45 OUT=$OUT/check timeout 200 tools/device/check.sh tests > $OUT/check.log 2>&1
echo "check.sh rc=$?" >> $T; cat $OUT/check/table.txt >> $T 2>/dev/null
K=configs/kimi-linear-48b-a3b.json
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(kda_proj|kda_core|kda_out|experts)$/ {printf "%s %s; ", $1, $2}' "$1"; }
bench() { # name, env (comma-separated), lunar bench arguments
  local n=$1 e=$2; shift 2
  env ${e//,/ } timeout 120 $P/bin/lunar bench $K --load-format dummy --backend cuda "$@" > $OUT/b_$n.log 2>&1
  echo "rc=$? $n [$e]: $(tpot $OUT/b_$n.log) $(pre $OUT/b_$n.log)" >> $T
}
step "KL48 table"
bench table LUNAR_NONE=0 --max-len 36864 --input-lens 1024,8192,32768 --batch-sizes 1,8,32,64 --contexts 1024
for r in 1 2; do
  step "A/B round $r"
  bench b1_def_$r LUNAR_NONE=0 --input-lens 1024 --batch-sizes 1 --contexts 1024 --steps 64
  [ -n "${ROUTE_AB:-}" ] && bench b1_route_$r "$ROUTE_AB" --input-lens 1024 --batch-sizes 1 --contexts 1024 --steps 64
  bench b3264_def_$r LUNAR_NONE=0 --input-lens 1024 --batch-sizes 32,64 --contexts 1024 --steps 32
  bench b3264_old_$r LUNAR_ROUTER=block,LUNAR_NORM=block --input-lens 1024 --batch-sizes 32,64 --contexts 1024 --steps 32
  bench p8k_def_$r LUNAR_NONE=0 --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 --profile
  bench p8k_async_$r LUNAR_KDA_CONV_ASYNC=1 --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 --profile
  bench p8k_bf16async_$r LUNAR_KDA_CONV_ASYNC=1,LUNAR_KDA_PREFILL=bf16 --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 --profile
done
step "K3.1 slice"
timeout 120 $P/bin/lunar bench configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93 --load-format dummy \
  --backend cuda --input-lens 8192 --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3.log 2>&1
echo "rc=$? $(tpot $OUT/k3.log) $(pre $OUT/k3.log)" >> $T
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=final.txt -- * && rm -rf check t_* b_* k3.log)
cat $T
