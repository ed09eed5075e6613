#!/usr/bin/env bash
# Issue 9, session 6: the weight prefetch before the PDL wait (LUNAR_PDL_PREFETCH, cuda_common.cuh).
# One call: the op tests of the kernels that prefetch, graphs with PDL + prefetch == eager without,
# compute-sanitizer on two of them, then Kimi-Linear-48B B = 1, 8 alternating prefetch on (2) / off
# (0) three times, the K3.1 TP8 slice on / off, and ncu's per-kernel time of one graphed step.
# A time budget (BUDGET s, default 125) skips what would not fit.
#   P=.xfer-NAME OUT=/tmp/o tools/device/decpdl.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
BUDGET=${BUDGET:-125}
SUMMARY=decpdl.txt . tools/device/env.sh
L=$(mktemp -d)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
nvidia-smi -L >> $T
for f in cuda_matmul_bf16 cuda_kda_gate_proj cuda_moe_experts_bf16 cuda_moe_experts_mxfp4 cuda_moe_shared_row \
         cuda_mla_absorbed cuda_forward_graphs_pdl; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests $f > $L/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $L/t_$f.log | cut -c1-300 | tail -6 >> $T
done
KL="bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8 --contexts 1024 --steps 32"
K3="bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 8192 --steps 32"
run() { # TAG PREFETCH ARGS...
  local tag=$1 pf=$2; shift 2
  [ "$(left)" -gt 12 ] || { echo "skip $tag (budget)" >> $T; return; }
  step "$tag (LUNAR_PDL_PREFETCH=$pf)"
  LUNAR_PDL_PREFETCH=$pf timeout 25 $P/bin/lunar "$@" > $L/$tag.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $L/$tag.txt | head -5 >> $T; grep -iE 'graphs|error|abort' $L/$tag.txt | head -3 >> $T
}
for r in 1 2 3; do
  run kl_on_$r 2 $KL
  run kl_off_$r 0 $KL
done
run k3_on 2 $K3
run k3_off 0 $K3
if command -v compute-sanitizer > /dev/null && [ "$(left)" -gt 30 ]; then
  for f in cuda_matmul_bf16 cuda_moe_shared_row; do
    step "compute-sanitizer memcheck lunar_tests $f (prefetch on)"
    timeout 25 compute-sanitizer --tool memcheck $P/bin/lunar_tests $f > $L/san_$f.log 2>&1; echo "rc=$?" >> $T
    grep -E 'ERROR SUMMARY|passed, |FAILED' $L/san_$f.log | head -3 >> $T
  done
else echo "compute-sanitizer: $(command -v compute-sanitizer || echo none), left $(left) s" >> $T; fi
for pf in 0 2; do
  [ "$(left)" -gt 20 ] || { echo "skip ncu $pf (budget)" >> $T; continue; }
  step "ncu per kernel, one graphed step, B = 1 (LUNAR_PDL_PREFETCH=$pf)"
  LUNAR_PDL_PREFETCH=$pf timeout $(( $(left) - 5 )) ncu --clock-control none --graph-profiling node \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv $P/bin/lunar bench configs/kimi-linear-48b-a3b.json \
    --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 1024 --steps 1 --warmup-iters 0 \
    > $L/ncu_$pf.csv 2> $L/ncu_$pf.err; echo "rc=$? rows $(wc -l < $L/ncu_$pf.csv)" >> $T
  grep -iE 'nodes in the last|error' $L/ncu_$pf.err | head -3 >> $T
done
step done
(cd "$L" && tar czf "$OUT/all.tgz" -- *)
cat $T
