#!/usr/bin/env bash
# History (session 9): path 13 and LUNAR_MOE_PREFILL=wsmx were removed; its wsmx steps now run the defaults.
# Issue 8, session 7: MoE prefill path 13 (MXFP4 widened in the consumer warpgroups, cuda_moe_ws.cu)
# in one device call. Run from the repository root with P = the prebuilt directory and OUT:
#   P=.xfer-mx4pre OUT=/tmp/o tools/device/mx4pre.sh
# op tests (every MXFP4 experts case, path 13 among the others, vs the CPU op; the latent routed
# path and the goldens with LUNAR_MOE_PREFILL=wsmx), the prefill benchmark of K3.1's shapes (dense
# peak first; paths 2 / 4 / 6 / 13), the K3.1 TP8 slice 8K prefill default vs wsmx (--profile), and
# (time left) Nsight Compute on path 13's gate/up kernel. Stops early past BUDGET seconds.
# Call 1 (binaries of de625a8, path 13 opt-in): the defaults below. Call 2 (1dcf7f3, path 13 the
# MXFP4 default): K3_MODES=default FWD=0 NCU=0.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
BUDGET=${BUDGET:-100}
SUMMARY=mx4pre.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (paths 1-6, 8, 9, 13 vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsmx |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-160 | tail -40 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill benchmark (LUNAR_MOE_BENCH=prefill-mxfp4)"
LUNAR_MOE_BENCH=prefill-mxfp4 timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-170 >> $T
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --profile"
for m in ${K3_MODES:-wsmx default}; do
  late $BUDGET && { step "skipped K3.1 $m: past budget"; continue; }
  step "K3.1 TP8 slice 8K prefill LUNAR_MOE_PREFILL=$m"
  if [ $m = default ]; then timeout 45 $S > $OUT/k3_$m.txt 2>&1; else LUNAR_MOE_PREFILL=$m timeout 45 $S > $OUT/k3_$m.txt 2>&1; fi
  echo "rc=$?" >> $T
  grep -E -A3 '^prefill' $OUT/k3_$m.txt | head -4 >> $T
  grep -E 'experts|moe|abort|rror|project' $OUT/k3_$m.txt | head -8 >> $T
done
[ "${FWD:-1}" = 1 ] && ! late $BUDGET && { step "LUNAR_MOE_PREFILL=wsmx: cuda_moe_layer, cuda_forward (MXFP4 goldens on path 13)"
  LUNAR_MOE_PREFILL=wsmx OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_layer > $OUT/t_layer.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_layer.log | cut -c1-160 | tail -4 >> $T
  LUNAR_MOE_PREFILL=wsmx OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -16 >> $T; }
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null && ! late $BUDGET; then
  step "ncu K3.1 moe_wx_kernel<GATEUP> (first launch: K3.1 full shape)"
  LUNAR_MOE_BENCH=prefill-mxfp4 timeout 40 ncu --clock-control none --kernel-name-base mangled -k regex:moe_wx_kernelILb1 -c 1 \
    --section SpeedOfLight --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_wx.txt 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe_wx_kernel|Duration|Throughput|Warp Cycles|Issued' $OUT/ncu_wx.txt | cut -c1-150 | head -16 >> $T
  grep -E 'issue_stalled' $OUT/ncu_wx.txt | awk '$NF + 0 >= 0.05' | sed 's/smsp__average_warps_issue_stalled_//' | cut -c1-110 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4pre.txt -- * && rm -f k3_*.txt ncu_*.txt t_fwd.log t_layer.log)  # 8 files come back
cat $T
