#!/usr/bin/env bash
# K3 / K3.1 decode steps under CUDA graphs, in one device call (prebuilt binaries in DIR/bin,
# libraries in DIR/lib, as graphs.sh / session.sh; nothing is built here): the CUDA forward tests
# this work touches (graphs == eager on the Kimi-Linear and the K3-shaped model, captures and
# replays counted; the K3-shaped model vs the CPU; the rest of cuda_forward runs in check.sh),
# then the K3.1 Pro TP8 rank slice (10 layers projected to 93, dummy weights) with graphs on and
# with --enforce-eager, B = 1, 8, 64 at context 8192. Logs under $OUT; the
# summary (both bench tables last) is printed at the end. At most ~90 s (each step's timeout is cut
# to what is left of 88 s).
#   tools/device/k3graphs.sh DIR
set -u
P=${1:?usage: k3graphs.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-k3graphs}
. tools/device/env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
# every command under a timeout of at most CAP s and at most what is left of 88 s in all
cap() { local left=$(( 88 - ($(date +%s) - t0) )); [ $left -lt 1 ] && left=1; [ $1 -lt $left ] && echo $1 || echo $left; }

step "lunar_tests cuda_forward_graphs (graphs == eager: kimi-linear B=1,3,6, k3 B=1,3) + cuda_forward_k3 (k3 vs CPU)"
: > "$OUT/tests.log"
for f in cuda_forward_graphs cuda_forward_k3; do
  OMP_NUM_THREADS=16 timeout $(cap 25) "$P/bin/lunar_tests" $f >> "$OUT/tests.log" 2>&1
  echo "$f rc=$?" >> "$T"
done
grep -E "MoE, B=|k3, |passed|FAIL|abort|CUDA error|captured decode step|graphs disabled" "$OUT/tests.log" | head -30 >> "$T"

B="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93
   --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 8192"
for v in graphs eager; do
  flags=; [ $v = eager ] && flags=--enforce-eager
  step "bench K3.1 TP8 slice, 10 layers -> 93 ($v)"
  timeout $(cap 40) $B $flags > "$OUT/bench_$v.txt" 2>&1
  rc=$?
  echo "rc=$rc" >> "$T"
  grep -iE "CUDA graphs|error|abort|captured decode step" "$OUT/bench_$v.txt" | head -4 >> "$T"
  [ $rc = 0 ] || tail -3 "$OUT/bench_$v.txt" >> "$T"
done
step "done"
for v in graphs eager; do
  echo "---- K3.1 slice decode, $v (bench_$v.txt)" >> "$T"
  sed -n '/^decode /,$p' "$OUT/bench_$v.txt" | head -30 >> "$T"
done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -mindepth 1 ! -name logs.tgz ! -name summary.txt -delete)
cat "$T"
