#!/usr/bin/env bash
# Session 7, s7-gemv's second device call (as run at 771ac8c): the bulk-copy gemv (LUNAR_GEMV_BULK=1; x in shared
# memory, all-shared carveout) in two rings against the deep default and the session-5 kernel: bench_cuda gemv,
# the skinny-GEMM op tests, graphs == eager, Kimi-Linear B = 1 / 8 A/B in two alternating rounds, the K3.1 slice.
# P holds bin/{lunar,lunar_tests,bench_cuda} and lib/ (tools/device/prebuild.sh's layout; bench_cuda linked
# against build/liblunar.a). docs/benchmarks.md "Decode B = 1: gemv streams (session 7, H200)".
#   P=<prebuilt dir> tools/device/s7_gemv.sh
set -u
P=${P:-.xfer-gemv}
OUT=${OUT:-/tmp/o}
SUMMARY=sum.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
el() { echo $(( $(date +%s) - t0 )); }
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
step "bench_cuda gemv"
timeout 60 $P/bin/bench_cuda gemv > $OUT/gemv_bench.txt 2>&1; rc=$?
echo "rc=$rc" >> $T; cat $OUT/gemv_bench.txt >> $T
[ $rc = 0 ] || { step "bench failed: stop"; cat $T; exit 0; }
step "lunar_tests cuda_matmul (default; gemv_kernels runs every kind)"
OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_matmul > $OUT/t_matmul.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|differs|!=' $OUT/t_matmul.log | cut -c1-200 | tail -8 >> $T
B8="LUNAR_GEMV_BULK=1 LUNAR_GEMV_BULK_SEG=8192 LUNAR_GEMV_BULK_STAGES=3"
B2="LUNAR_GEMV_BULK=1 LUNAR_GEMV_BULK_SEG=4096 LUNAR_GEMV_BULK_STAGES=2 LUNAR_GEMV_BULK_BPS=2"
for f in cuda_matmul_bf16 cuda_kda_gate_proj cuda_forward_graphs; do
  step "bulk 8K x3: lunar_tests $f"
  env $B8 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/tb_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/tb_$f.log | cut -c1-200 | tail -4 >> $T
done
step "bulk 4K x2 2/SM: lunar_tests cuda_matmul_bf16"
env $B2 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_matmul_bf16 > $OUT/tb2.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/tb2.log | cut -c1-200 | tail -4 >> $T
for r in 1 2; do
  i=0
  for v in "LUNAR_NONE=0" "$B8" "LUNAR_GEMV_DEEP=0" "$B2"; do
    i=$((i+1))
    [ $(el) -lt 100 ] || { step "skip KL48 $i round $r (time)"; continue; }
    step "KL48 [$v] round $r"
    env $v timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8 \
      --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
i=0
for v in "LUNAR_NONE=0" "$B8" "LUNAR_GEMV_DEEP=0"; do
  i=$((i+1))
  [ $(el) -lt 110 ] || { step "skip K3.1 $i (time)"; continue; }
  step "K3.1 slice [$v]"
  env $v timeout 60 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 \
    --contexts 8192 > $OUT/k3_$i.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_$i.log) $(grep -iE 'projected|93' $OUT/k3_$i.log | head -3 | tr '\n' ' ')" >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=sum.txt --exclude=gemv_bench.txt -- * && rm -f t_* tb* ab_* k3_*)
cat $T
