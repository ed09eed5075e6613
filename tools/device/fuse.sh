#!/usr/bin/env bash
# Decode launch fusion (issue 9), in one device call (prebuilt binaries in DIR/bin, libraries in
# DIR/lib, as session.sh; nothing is built here): lunar bench of Kimi-Linear-48B-A3B and the K3.1
# TP8 slice (dummy weights) at batch 1 with the fused launches and with LUNAR_CUDA_FUSE=0 (main's
# launch sequence), one batch size per run so that the graph node count printed is that batch's;
# Kimi-Linear at batch 64 and a profiled batch-1 step; then the op tests of the fused launches (GPU
# 1 where there is one) beside lunar_tests cuda_forward (goldens, kernel-shaped models vs the CPU,
# graphs == eager). ~30 s warm. Logs under $OUT/logs (tarred), the summary in $OUT/fuse.txt.
#   tools/device/fuse.sh DIR
set -u
P=${1:?usage: fuse.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-fuse}
L=$OUT/logs
mkdir -p "$L"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2> /dev/null)
export LD_LIBRARY_PATH="$P/lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
T=$OUT/fuse.txt
: > "$T"
t0=$(date +%s)
step() { echo "== $1 (t = $(( $(date +%s) - t0 )) s)" | tee -a "$T"; }
KL="configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --contexts 1024"
K31="configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda
  --input-lens 1024 --contexts 8192"
run() { # name LUNAR_CUDA_FUSE batch-sizes bench-args...
  local name=$1 fz=$2 bs=$3
  shift 3
  step "$name"
  LUNAR_CUDA_FUSE=$fz CUDA_VISIBLE_DEVICES=0 timeout 40 "$P/bin/lunar" bench "$@" --batch-sizes "$bs" > "$L/$name.txt" 2>&1
  echo "rc=$?" >> "$T"
  grep -E "graphs on|^ +(1|64) +(1024|8192) " "$L/$name.txt" >> "$T"
}
# shellcheck disable=SC2086
{
  run kl_b1_fused "" 1 $KL
  run kl_b1_off 0 1 $KL
  run kl_b64_fused "" 64 $KL
  run kl_prof_fused "" 1 $KL --profile
  run k31_b1_fused "" 1 $K31
  run k31_b1_off 0 1 $K31
}
step tests
GPU2=$(nvidia-smi -L 2> /dev/null | wc -l)
[ "$GPU2" -ge 2 ] && GPU2=1 || GPU2=0
(
  for f in cuda_kda_gate_proj cuda_add_rmsnorm cuda_kda_conv_qkv cuda_moe_route_one cuda_kda_gate_vs cuda_moe_router; do
    CUDA_VISIBLE_DEVICES=$GPU2 OMP_NUM_THREADS=8 LUNAR_TEST_VERBOSE=1 timeout 40 "$P/bin/lunar_tests" $f
  done > "$L/ops.log" 2>&1
) &
CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 timeout 120 "$P/bin/lunar_tests" cuda_forward > "$L/forward.log" 2>&1
echo "forward rc=$?" >> "$T"
wait
grep -E "passed|FAIL|failed|abort|error" "$L/ops.log" >> "$T"
grep -E "passed|FAIL|failed|abort|error|tests/|steps differ" "$L/forward.log" | head -40 >> "$T"
step "done"
echo "---- Kimi-Linear batch-1 profile (fused)" >> "$T"
sed -n '/^profile of one decode/,/sum/p' "$L/kl_prof_fused.txt" >> "$T"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$T"
