#!/usr/bin/env bash
# Issue 8, session 6, second call: path 12 (path 6 with the SFU's exp / tanh / division in the
# gate/up epilogue, LUNAR_MOE_PREFILL=wsfast) and the Kimi-Linear prefill shape with its own
# activation (SwiGLU; sessions 3-5 benchmarked it with K3's SiTU). Run from the repository root:
#   P=.xfer-moepre6 OUT=/tmp/o tools/device/moe_pf2.sh
# BF16 op tests, the BF16 prefill benchmark (dense peak first), the goldens with wsfast,
# Kimi-Linear-48B 8K prefill default vs wsfast, ncu on path 6's SwiGLU kernels.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=moe_pf2.txt . tools/device/env.sh
step "op tests: cuda_moe_experts_bf16 (paths 1-12 vs the CPU ops)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_moe_experts_bf16 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsfast |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-130 | tail -20 >> $T
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; cat $T; exit 1; fi
step "prefill benchmark (LUNAR_MOE_BENCH=prefill-bf16)"
LUNAR_MOE_BENCH=prefill-bf16 timeout 30 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-120 >> $T
step "cuda_forward with LUNAR_MOE_PREFILL=wsfast (BF16 path 12, MXFP4 path 4)"
LUNAR_MOE_PREFILL=wsfast OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |steps differ|median' $OUT/t_fwd.log | cut -c1-160 | tail -16 >> $T
KL="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 1024 --profile"
for m in default wsfast; do
  step "KL48 8K prefill LUNAR_MOE_PREFILL=$m"
  if [ $m = default ]; then timeout 20 $KL > $OUT/kl_$m.txt 2>&1; else LUNAR_MOE_PREFILL=$m timeout 20 $KL > $OUT/kl_$m.txt 2>&1; fi
  echo "rc=$?" >> $T
  grep -E '^ +8192 |experts' $OUT/kl_$m.txt | head -3 >> $T
done
if command -v ncu > /dev/null; then
  for k in ILb0ELb1ELb0ELi0E ILb0ELb0ELb0ELi0E; do  # path 6 gate/up, down; first launch = SwiGLU row
    step "ncu Kimi-Linear swiglu moe_ws_kernel$k"
    LUNAR_MOE_BENCH=prefill-bf16 timeout 25 ncu --clock-control none --kernel-name-base mangled -k regex:moe_ws_kernel$k -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$k.txt 2>&1
    echo "rc=$?" >> $T
    grep -E 'Duration|Throughput|L2 Hit' $OUT/ncu_$k.txt | cut -c1-100 | head -10 >> $T
  done
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moe_pf2.txt -- * && rm -f kl_*.txt ncu_*.txt t_fwd.log)
cat $T
