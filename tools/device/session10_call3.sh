#!/usr/bin/env bash
# Session 10, the lead's third call (one H200): (1) the B=1 bisection between d0b593b and main (binmulti.sh, the
# builds in $P/bis/), (2) s10-alias verified: the CUDA tests of the kernels it touched (attnres, the MoE
# permutation) and the model tests, then main before the merge (bin/lunar_prealias) against main on the K3.1 slice
# (its attnres fix: decode B=1 and the 8K prefill) and Kimi-Linear B=8 (the scatter fix).
#   P=<prebuilt dir> tools/device/session10_call3.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
export P OUT
SUMMARY=c3.txt . tools/device/env.sh
for f in cuda_attnres cuda_moe_ cuda_forward; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
step "bisection d0b593b..main, Kimi-Linear B=1"
BINS="$(ls $P/bis/lunar_* | tr '\n' ' ')" ROUNDS=3 timeout 150 bash tools/device/binmulti.sh > /dev/null 2>&1
grep -E '^(round|mean)' $OUT/binmulti.txt >> $T
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10"
step "K3.1 slice B=1: prealias (A) vs main (B)"
MODEL="$S" A=$P/bin/lunar_prealias B=$P/bin/lunar ROUNDS=2 timeout 100 tools/device/binab.sh > /dev/null 2>&1
grep rc= $OUT/binab.txt >> $T
step "K3.1 slice 8K prefill: prealias (A) vs main (B)"
MODEL="$S" PREFILL=1 A=$P/bin/lunar_prealias B=$P/bin/lunar ROUNDS=2 timeout 120 tools/device/binab.sh > /dev/null 2>&1
grep rc= $OUT/binab.txt >> $T
step "Kimi-Linear B=8: prealias (A) vs main (B)"
BATCH=8 A=$P/bin/lunar_prealias B=$P/bin/lunar ROUNDS=2 timeout 100 tools/device/binab.sh > /dev/null 2>&1
grep rc= $OUT/binab.txt >> $T
step done
rm -f $OUT/binab.tgz $OUT/bm.log
cat $T
