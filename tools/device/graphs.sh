#!/usr/bin/env bash
# Decode launch work on the device, in one call (prebuilt binaries in DIR/bin, libraries in DIR/lib,
# as session.sh): the CUDA tests (ops, forward incl. graphs == eager), the CUDA engine stress test,
# lunar bench of Kimi-Linear-48B-A3B (dummy) with graphs on, --enforce-eager, LUNAR_CUDA_GEMV=0
# (cuBLASLt for every GEMM), LUNAR_MLA_ABSORB=gemm, and --profile, and lunar serve + bench serve
# (SERVE_GRAPHS="1 0": with graphs on and off; empty: none). ENGINE=0 skips the engine test,
# VARIANTS="name [ENV=V] [--flag],..." picks the bench runs. Logs under $OUT.
#   tools/device/graphs.sh DIR
set -u
P=${1:?usage: graphs.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-graphs}
. tools/device/env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}

step "lunar_tests cuda (ops incl. skinny GEMM / add+rmsnorm / MLA row kernels, forward on goldens + wide, graphs == eager, TP)"
OMP_NUM_THREADS=16 timeout 120 "$P/bin/lunar_tests" cuda > "$OUT/tests_cuda.log" 2>&1
echo "rc=$?" >> "$T"; grep -E "MoE, B=|passed|FAIL|abort|CUDA error|absorb rows|matmul n=[1-8] " "$OUT/tests_cuda.log" | head -24 >> "$T"
[ "${ENGINE:-1}" = 1 ] && {
step "lunar_tests engine_stress (CUDA)"
OMP_NUM_THREADS=16 timeout 40 "$P/bin/lunar_tests" engine_stress > "$OUT/engine.log" 2>&1
echo "rc=$?" >> "$T"; grep -E "passed|FAIL|abort|CUDA error" "$OUT/engine.log" | head -5 >> "$T"
}

B="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024"
VARIANTS=${VARIANTS:-graphs,eager --enforce-eager,cublaslt LUNAR_CUDA_GEMV=0,absorbgemm LUNAR_MLA_ABSORB=gemm}
IFS=, read -r -a VS <<< "$VARIANTS"
for v in "${VS[@]}"; do
  set -- $v; name=$1; shift
  flags=; envs=
  for a in "$@"; do case $a in --*) flags="$flags $a" ;; *) envs="$envs $a" ;; esac; done
  step "bench KL48 ($name:$envs$flags)"
  env $envs timeout 60 $B --batch-sizes 1,8,64 --contexts 1024,32768 $flags > "$OUT/bench_$name.txt" 2>&1
  echo "rc=$?" >> "$T"; grep -E "CUDA graphs|^ +[0-9]+ +[0-9]+ +[0-9.]+ " "$OUT/bench_$name.txt" >> "$T"
done
step "bench KL48 B=1 --profile (the profiled steps run eagerly)"
timeout 60 $B --batch-sizes 1 --contexts 1024 --profile > "$OUT/bench_profile.txt" 2>&1
echo "rc=$?" >> "$T"; sed -n '/^profile of one decode/,/sum/p' "$OUT/bench_profile.txt" >> "$T"

for g in ${SERVE_GRAPHS-1}; do
  step "serve KL48 + bench serve 1024/128/64/32, LUNAR_CUDA_GRAPHS=$g"
  PORT=$((18780 + g))
  LUNAR_CUDA_GRAPHS=$g "$P/bin/lunar" serve configs/kimi-linear-48b-a3b.json --load-format dummy \
    --tokenizer models/kimi-linear-tiny --backend cuda --port $PORT --max-model-len 4096 --max-num-seqs 64 --quiet \
    > "$OUT/serve_$g.log" 2>&1 &
  spid=$!
  python3 - $PORT << 'PY'
import sys, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
PY
  timeout 60 "$P/bin/lunar" bench serve --base-url "http://127.0.0.1:$PORT" --input-len 1024 --output-len 128 \
    --num-prompts 64 --max-concurrency 32 > "$OUT/bench_serve_$g.txt" 2>&1
  echo "rc=$?" >> "$T"; grep -E "Successful|Failed|Output token throughput|Mean TPOT|Median TPOT|Mean TTFT" "$OUT/bench_serve_$g.txt" >> "$T"
  kill $spid 2> /dev/null; wait $spid 2> /dev/null
  grep -iE "error|graphs|abort" "$OUT/serve_$g.log" | head -3 >> "$T"
done
step "done"
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -mindepth 1 ! -name logs.tgz ! -name summary.txt -delete)
cat "$T"
