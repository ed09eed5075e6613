#!/usr/bin/env bash
# The per-kernel table of one eager decode step of the K3.1 TP8 slice at batch 1 (10 layers, 8K context), as
# decb1.sh's NCU=1 does for Kimi-Linear: Nsight Compute, application replay, each kernel alone (no PDL overlap),
# gpu__time_duration and dram__bytes_read, summed by kernel name (tools/device/ncu_step.py). The dummy load's
# kernels are filtered out by name. Then the graphed step (lunar bench, 3 runs) for the overhead beside the sum.
#   P=<prebuilt dir> OUT=<dir> tools/device/k3b1_ncu.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=k3b1.txt . tools/device/env.sh
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10"
step "graphed step, 3 runs"
for r in 1 2 3; do
  timeout 60 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 8192 \
    --steps 64 > $OUT/g$r.log 2>&1
  grep -A3 '^decode ' $OUT/g$r.log | awk '$1 ~ /^[0-9]+$/ {print "B" $1 " ctx " $2 " TPOT " $3 " ms, floor " $6 " ms"}' >> $T
done
step "ncu: one K3.1 slice B=1 decode step, per kernel"
timeout 150 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale|k_e8m0|k_fp8|k_u8|dummy)' --launch-count 4000 \
  $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 8192 --steps 1 \
  > $OUT/ncu_k3.csv 2> $OUT/ncu_k3.err
echo "ncu rc=$?" >> $T; tail -3 $OUT/ncu_k3.err >> $T
gzip $OUT/ncu_k3.csv; python3 tools/device/ncu_step.py $OUT/ncu_k3.csv.gz -3 > $OUT/ncu_k3_table.md 2>&1
head -60 $OUT/ncu_k3_table.md >> $T
step done
cat $T
