#!/usr/bin/env bash
# One device call on one H200 (about 3 minutes) that verifies and then makes issue 9's table:
# tools/device/check.sh tests (every CUDA op vs its CPU op, the forward on every golden, the engine,
# generate, serve), the PTPC / DCP (one-GPU parts) / NCCL / graphs tests, lunar bench for
# Kimi-Linear-48B (whole model) and the Kimi-K3.1 Pro TP8 rank slice (10 layers projected to 93)
# at 1K-128K, and lunar serve + lunar bench serve with the seed's two workloads scaled to one GPU.
# (Session 4's final call ran this, with the 128K contexts in a second call.)
#   tools/device/prebuild.sh DIR            (here; carry DIR and build-device)
#   tools/device/table.sh DIR               (on the device; the summary is $OUT/final.txt)
set -u
cd "$(dirname "$0")/../.."
P=${1:?usage: table.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-table}
SUMMARY=final.txt . tools/device/env.sh
nvidia-smi -L >> $T
step "check.sh tests (op tests vs CPU ops, forward goldens, engine, generate, serve)"
SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=120 ENGINE_TIMEOUT=45 OUT=$OUT/check timeout 200 tools/device/check.sh tests > $OUT/check.log 2>&1
echo "check.sh rc=$?" >> $T; cat $OUT/check/table.txt >> $T 2>/dev/null; cat $OUT/check/op_errors.txt >> $T 2>/dev/null
for f in ptpc cuda_dcp nccl dummy_device cuda_forward_graphs; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |vs CPU|bitwise|skipped' $OUT/t_$f.log | cut -c1-300 | tail -8 >> $T
done
step "bench Kimi-Linear-48B (one GPU)"
timeout 100 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --max-len 139264 \
  --input-lens 1024,8192,32768 --batch-sizes 1,8,32,64 --contexts 1024,32768,131072 --json $OUT/kl48.json > $OUT/kl48.txt 2>&1
echo "rc=$?" >> $T; sed -n '/^bandwidth/,$p' $OUT/kl48.txt >> $T
step "bench Kimi-Linear-48B prefill 128K"
timeout 60 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --warmup-iters 0 \
  --input-lens 131072 --batch-sizes 1 --contexts 1024 --json $OUT/kl48_128k.json > $OUT/kl48_128k.txt 2>&1
echo "rc=$?" >> $T; grep -A2 '^prefill' $OUT/kl48_128k.txt >> $T
step "bench K3.1 TP8 slice, 10 layers -> 93"
timeout 80 $P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 \
  --backend cuda --max-len 139264 --input-lens 8192,32768 --batch-sizes 1,8,64 --contexts 8192,131072 --json $OUT/k31.json \
  > $OUT/k31.txt 2>&1
echo "rc=$?" >> $T; sed -n '/^bandwidth/,$p' $OUT/k31.txt >> $T
serve_bench() { # TAG WORKLOADS BENCH_FLAGS MODEL [serve flags]
  local tag=$1 wl=$2 bflags=$3 port=18778; shift 3
  $P/bin/lunar serve "$@" --load-format dummy --tokenizer models/kimi-linear-tiny --backend cuda --port $port \
    --max-num-seqs 64 --quiet > $OUT/serve_$tag.log 2>&1 &
  local spid=$!
  python3 -c "
import sys, time, urllib.request
for _ in range(240):
    try: urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1); break
    except Exception: time.sleep(0.5)"
  for w in $wl; do
    IFS=/ read -r il ol np mc <<< "$w"
    timeout ${SERVE_TIMEOUT:-70} $P/bin/lunar bench serve --base-url http://127.0.0.1:$port --input-len $il --output-len $ol \
      --num-prompts $np --max-concurrency $mc $bflags --result-file $OUT/serve_${tag}_$il.json > $OUT/serve_${tag}_$il.txt 2>&1
    echo "bench serve $tag $w rc=$?" >> $T; grep -E 'TTFT|TPOT|ITL|E2E|throughput|Successful|Failed' $OUT/serve_${tag}_$il.txt >> $T
  done
  kill $spid; wait $spid 2> /dev/null
  grep -iE 'error|CUDA' $OUT/serve_$tag.log | head -3 >> $T
}
step "serve Kimi-Linear-48B: 8K->1K x16 conc 8, 128K->100 x2 conc 1"
serve_bench kl48 "8192/1024/16/8 131072/100/2/1" "" configs/kimi-linear-48b-a3b.json --max-model-len 140000
step "serve K3.1 slice: 8K->512 x16 conc 8 (the slice's vocabulary is one rank's share; the K3 guard off)"
SERVE_TIMEOUT=50 serve_bench k31 "8192/512/16/8" "--vocab-size 20480" configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 \
  --max-model-len 20000 --sampling-guard off
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=final.txt -- *)
cat $T
