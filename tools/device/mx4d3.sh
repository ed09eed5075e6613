#!/usr/bin/env bash
# Session 14 (branch s14-mx4d), third call: the op tests that use the MXFP4 prefill default (path 32 since
# this branch) outside the experts suite: cuda_moe_layer and cuda_forward_k3.
#   P=<prebuilt dir> OUT=<dir> bash mx4d3.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
for t in cuda_moe_layer cuda_forward_k3; do
  step "$t (the default: path 32)"
  OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests $t > $OUT/t_$t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |k3, |CHECK|err' $OUT/t_$t.log | sed 's/, argmax.*//' | cut -c1-200 | tail -6 >> $T
done
step done
cat $T
