#!/usr/bin/env bash
# Tensor-parallel decode without host syncs (issue 10), in one device call on 2 GPUs (prebuilt
# binaries in DIR/bin, libraries in DIR/lib, as session.sh; nothing is built here): the new ops'
# tests and the TP tests (TP 2 vs one GPU on the goldens and dummy shards, TP serve), then lunar
# bench of Kimi-Linear-48B-A3B (dummy) at TP 1 and TP 2, TP 2 with its decode steps captured into
# CUDA graphs (LUNAR_TP_GRAPHS=1, opt-in; its test and bench last), and the K3.1 TP8 per-rank step on
# 2 ranks. Every command under `timeout`; logs under $OUT (tarred), the summary printed last. TP1=0
# skips the one-GPU bench, GRAPHS=0 the TP graphs' test and bench. Run from a tree with configs/ and tests/ (the goldens).
#   tools/device/tpdecode.sh DIR
set -u
P=${1:?usage: tpdecode.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-tpdecode}
. tools/device/env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
# the bench's result rows, its graph line, and what a failed run said (its messages start "lunar")
rows() { grep -E "^lunar bench: (CUDA graphs|rank|[^l])|rror|abort|^  (prefill|decode) .*: [^d]|^ +[0-9]+ +[0-9.]+ +[0-9.]+ |projected" "$1" | grep -v "^lunar bench: second" | head -14 >> "$T"; }

step "lunar_tests: embedding_range, copy_2d (ops vs CPU) and cuda_tp (TP 2 vs 1 GPU, dummy shards, TP serve)"
OMP_NUM_THREADS=16 timeout 15 "$P/bin/lunar_tests" cuda_embedding_range > "$OUT/tests_ops.log" 2>&1
echo "ops rc=$?" >> "$T"
OMP_NUM_THREADS=16 timeout 10 "$P/bin/lunar_tests" cuda_copy_2d >> "$OUT/tests_ops.log" 2>&1
echo "copy_2d rc=$?" >> "$T"; grep -E "passed|FAIL|abort|CUDA error|exact" "$OUT/tests_ops.log" | head -8 >> "$T"
OMP_NUM_THREADS=16 timeout 60 "$P/bin/lunar_tests" cuda_tp > "$OUT/tests_tp.log" 2>&1
echo "cuda_tp rc=$?" >> "$T"; grep -E "passed|FAIL|abort|CUDA error|diverg|argmax|median|graphs" "$OUT/tests_tp.log" | head -12 >> "$T"

B="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --contexts 1024"
[ "${TP1:-1}" = 1 ] && {
step "bench KL48 TP 1"
timeout 25 $B --input-lens 8192 --batch-sizes 1,8,64 > "$OUT/bench_tp1.txt" 2>&1
echo "rc=$?" >> "$T"; rows "$OUT/bench_tp1.txt"
}
step "bench KL48 TP 2 (eager decode)"
timeout 30 $B --input-lens 8192 --batch-sizes 1,8,64 --tensor-parallel-size 2 > "$OUT/bench_tp2.txt" 2>&1
echo "rc=$?" >> "$T"; rows "$OUT/bench_tp2.txt"
step "bench K3.1 TP8 per-rank step on 2 ranks (--tp-slice 4, 10 of 93 layers)"
timeout 40 "$P/bin/lunar" bench configs/kimi-k3.1-pro.json --load-format dummy --backend cuda --tp-slice 4 \
  --tensor-parallel-size 2 --num-layers 10 --project-layers 93 --input-lens 1024 --batch-sizes 1,8 \
  --contexts 1024 > "$OUT/bench_k31.txt" 2>&1
echo "rc=$?" >> "$T"; rows "$OUT/bench_k31.txt"
# last: the opt-in TP graphs (a capture out of step between the ranks would hang until the timeout)
[ "${GRAPHS:-1}" = 1 ] && {
step "lunar_tests graphs_tp_cuda_match_eager (KL48 x4 layers TP 2: LUNAR_TP_GRAPHS=1 vs eager logits)"
OMP_NUM_THREADS=16 timeout 40 "$P/bin/lunar_tests" graphs_tp_cuda > "$OUT/tests_tp_graphs.log" 2>&1
echo "rc=$?" >> "$T"; grep -E "passed|FAIL|abort|CUDA error|graphs|rror" "$OUT/tests_tp_graphs.log" | head -6 >> "$T"
step "bench KL48 TP 2, LUNAR_TP_GRAPHS=1 (decode steps captured, NCCL inside the graphs)"
LUNAR_TP_GRAPHS=1 timeout 25 $B --input-lens 128 --batch-sizes 1,8,64 --tensor-parallel-size 2 \
  > "$OUT/bench_tp2_graphs.txt" 2>&1
echo "rc=$?" >> "$T"; rows "$OUT/bench_tp2_graphs.txt"
}
step "done"
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -mindepth 1 ! -name logs.tgz ! -name summary.txt -delete)
cat "$T"
