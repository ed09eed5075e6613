#!/usr/bin/env bash
# Issue 8, session 7, call 2: path 16 restricted to bounded h (SiTU with the clamp) and made the
# MXFP4 decode default; the MoE op tests, the K3.1 shapes at batch 1 with the f16 kernels' split-K
# capped at 4 (auto) / 2 / 1, one K3.1 slice run with the new default.
set -u
P=${P:?}; OUT=${OUT:-/tmp/o}
SUMMARY=moedec7b.txt . tools/device/env.sh
step "op tests: cuda_moe_ (router, experts incl. f16 vs the CPU, shared row, latent routed path)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_ > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|f16|routed' $OUT/t_moe.log | cut -c1-160 | tail -24 >> $T
for s in 0 2 1; do
  step "decode1 bench, LUNAR_MOE_F16_SPLIT=$s"
  LUNAR_MOE_F16_SPLIT=$s LUNAR_MOE_BENCH=decode1 timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/b1_$s.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/b1_$s.log >> $T
done
step "K3.1 slice, default"
timeout 40 $P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_default.txt 2>&1; echo "rc=$?" >> $T
sed -n '/^decode/,$p' $OUT/k3_default.txt | head -5 >> $T
step done
cat $T
