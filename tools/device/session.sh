#!/usr/bin/env bash
# A session's one device call, in priority order (each step capped so that the whole stays under
# the 10-minute limit of one call; whatever finished is in $OUT when a later step is cut off):
#   1. tools/device/check.sh tests: every CUDA op vs its CPU op, the model forward on every golden,
#      the engine on CUDA, generate and serve on CUDA (its table);
#   2. the device-only tests of the dummy loader (device values = host values), NCCL (world 1), the
#      CUDA rank processes (TP 2 on the goldens when there are two GPUs) and, with several GPUs,
#      lunar bench-comm;
#   3. lunar bench, Kimi-Linear-48B-A3B at full size on dummy weights (issue 9's first config);
#   4. lunar bench, the Kimi-K3.1 Pro TP8 rank slice (K31_LAYERS layers, projected to 93);
#   5. lunar serve (Kimi-Linear-48B, dummy, CUDA) driven by lunar bench serve (the seed's workloads
#      scaled down to the call: SERVE_WORKLOADS "in/out/prompts/concurrency ...", SERVE_FLAGS for
#      serve, e.g. --kv-cache-dtype fp8); with K31_SERVE_WORKLOADS the same for the K3.1 rank slice;
#   6. (MLA=1) tools/device/bench_mla_decode.sh: the MLA absorbed-decode kernels, new vs old.
# With PEER=1, right after step 3 on the same GPU: transformers' KimiLinearForCausalLM at the same
# points (tools/device/peer_transformers.py; random bf16 weights, fla's KDA kernels) and the two side by
# side. It needs the wheels the device lacks in PEER_WHEELS (default $P/wheels: transformers 5.24.0 and
# regex, `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`) and fla's in device/wheels.
# Binaries come prebuilt from the developer's machine (no jansson/pcre2/microhttpd on the device):
#   tools/device/prebuild.sh DIR   (then carry DIR and build-device)
#   tools/device/session.sh DIR    (on the device; logs and tables under $OUT)
set -u
cd "$(dirname "$0")/../.."
P=${1:?usage: session.sh PREBUILT_DIR}
OUT=${OUT:-/tmp/lunar-session}
SUMMARY=session.txt . tools/device/env.sh

step "check.sh tests"
SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=${OPS_TIMEOUT:-300} ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-45} OUT=$OUT/check \
  timeout ${CHECK_TIMEOUT:-300} tools/device/check.sh tests > "$OUT/check.log" 2>&1
echo "check.sh rc=$?" >> "$T"
sed -n '/^| check/,$p' "$OUT/check.log" >> "$T"

step "device-only tests: dummy weights, NCCL world size 1"
timeout 90 "$P/bin/lunar_tests" dummy_device > "$OUT/dummy_device.log" 2>&1
echo "dummy_device rc=$?: $(grep -E '^[0-9]+ passed' "$OUT/dummy_device.log")" >> "$T"
timeout 90 "$P/bin/lunar_tests" nccl > "$OUT/nccl.log" 2>&1
echo "nccl rc=$?: $(grep -E '^[0-9]+ passed' "$OUT/nccl.log") $(grep -iE 'error|skipped' "$OUT/nccl.log" | head -2)" >> "$T"
[ "${CUDA_TP:-1}" = 1 ] && {
timeout ${CUDA_TP_TIMEOUT:-180} "$P/bin/lunar_tests" cuda_tp > "$OUT/cuda_tp.log" 2>&1
echo "cuda_tp rc=$?: $(grep -E '^[0-9]+ passed' "$OUT/cuda_tp.log") $(grep -E 'vs|FAILED' "$OUT/cuda_tp.log" | head -6 | tr '\n' ' ')" >> "$T"
}

step "the fused AttnRes mix and RMSNorm against the bandwidth floor (their tests ran in check.sh)"
LUNAR_NORM_BENCH=1 timeout 60 "$P/bin/lunar_tests" cuda_attnres_bench > "$OUT/norm_bench.log" 2>&1
grep -E '^\||^floor' "$OUT/norm_bench.log" >> "$T"

NG=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
[ "$NG" -ge 2 ] && [ "${COMM:-1}" = 1 ] && {
step "all-reduce latency and bandwidth across the $NG GPUs (NCCL)"
timeout 90 "$P/bin/lunar" bench-comm --tensor-parallel-size "$NG" > "$OUT/bench_comm.txt" 2>&1
echo "bench-comm rc=$?" >> "$T"
cat "$OUT/bench_comm.txt" >> "$T"
}

step "lunar bench: Kimi-Linear-48B-A3B, dummy weights, CUDA"
timeout ${BENCH_TIMEOUT:-150} "$P/bin/lunar" bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
  --input-lens ${INPUT_LENS:-1024,8192} --batch-sizes ${BATCHES:-1,8,32} --contexts ${CONTEXTS:-1024,8192} ${BENCH_FLAGS:-} \
  --json "$OUT/kl48.json" > "$OUT/bench_kl48.txt" 2>&1
echo "bench rc=$?" >> "$T"
cat "$OUT/bench_kl48.txt" >> "$T"

[ "${PEER:-0}" = 1 ] && {
step "transformers peer: KimiLinearForCausalLM, random bf16 weights, fla KDA, lunar bench's points"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer-site \
  "${PEER_WHEELS:-$P/wheels}"/*.whl device/wheels/*.whl > "$OUT/peer_pip.log" 2>&1
echo "peer wheels rc=$?" >> "$T"
# its own lengths and points (a 48B model in eager PyTorch; fla autotunes its kernels on first use)
PYTHONPATH=/tmp/peer-site PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-240} python3 tools/device/peer_transformers.py \
  configs/kimi-linear-48b-a3b.json --input-lens ${PEER_INPUT_LENS:-1024,8192} --batch-sizes ${PEER_BATCHES:-1,8} \
  --contexts ${PEER_CONTEXTS:-1024} --json "$OUT/peer.json" > "$OUT/peer.txt" 2> "$OUT/peer.err"
echo "peer rc=$?" >> "$T"
# from the JSON it saved after every point, so a run cut off by its timeout still reports
python3 tools/device/peer_transformers.py --from-json "$OUT/peer.json" --lunar-json "$OUT/kl48.json" >> "$T" 2>&1 ||
  grep -vi warn "$OUT/peer.err" | tail -5 >> "$T"
}

step "lunar bench: Kimi-K3.1 Pro, one TP8 rank's slice, ${K31_LAYERS:=10} layers projected to 93, CUDA"
timeout ${K31_TIMEOUT:-120} "$P/bin/lunar" bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 \
  --num-layers $K31_LAYERS --project-layers 93 --backend cuda --input-lens ${K31_INPUT_LENS:-1024,8192} \
  --batch-sizes ${K31_BATCHES:-1,8,32} --contexts ${K31_CONTEXTS:-1024,8192} --json "$OUT/k31.json" > "$OUT/bench_k31.txt" 2>&1
echo "bench rc=$?" >> "$T"
cat "$OUT/bench_k31.txt" >> "$T"

# serve_bench TAG "WORKLOADS" "BENCH_SERVE_FLAGS" MODEL [serve options...]: lunar serve on dummy
# weights, driven by lunar bench serve for each workload "in/out/prompts/concurrency"
serve_bench() {
  local tag=$1 wl=$2 bflags=$3 port=18778
  shift 3
  "$P/bin/lunar" serve "$@" --load-format dummy --tokenizer models/kimi-linear-tiny --backend cuda --port $port \
    --max-num-seqs 64 --quiet > "$OUT/serve_$tag.log" 2>&1 &
  local spid=$!
  python3 - $port << 'PY'
import sys, time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
PY
  for w in $wl; do
    IFS=/ read -r il ol np mc <<< "$w"
    timeout ${SERVE_TIMEOUT:-100} "$P/bin/lunar" bench serve --base-url "http://127.0.0.1:$port" --input-len $il \
      --output-len $ol --num-prompts $np --max-concurrency $mc $bflags --result-file "$OUT/serve_${tag}_${il}_${ol}.json" \
      > "$OUT/serve_${tag}_${il}_${ol}.txt" 2>&1
    echo "bench serve $tag $w rc=$?" >> "$T"
    cat "$OUT/serve_${tag}_${il}_${ol}.txt" >> "$T"
  done
  kill $spid 2> /dev/null; wait $spid 2> /dev/null
  grep -E "lunar: CUDA|error" "$OUT/serve_$tag.log" | head -3 >> "$T"
}

[ "${SERVE:-1}" = 1 ] && {
step "lunar serve + lunar bench serve: Kimi-Linear-48B-A3B, dummy weights, CUDA"
serve_bench kl48 "${SERVE_WORKLOADS:-8192/1024/16/8 1024/128/64/32}" "" configs/kimi-linear-48b-a3b.json \
  --max-model-len ${SERVE_MAX_LEN:-20000} ${SERVE_FLAGS:-}
}

[ -n "${K31_SERVE_WORKLOADS:-}" ] && {
step "lunar serve + lunar bench serve: Kimi-K3.1 Pro TP8 rank slice, $K31_LAYERS layers, dummy weights, CUDA"
# the K3 sampling guard is off: bench serve pins the output length with min_tokens / ignore_eos; the
# slice's vocabulary is one rank's share (163840 / 8), so the prompts' ids are drawn below it
serve_bench k31 "$K31_SERVE_WORKLOADS" "--vocab-size 20480" configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers $K31_LAYERS \
  --max-model-len ${K31_SERVE_MAX_LEN:-20000} --sampling-guard off
}

[ "${MLA:-0}" = 1 ] && {
step "MLA absorbed decode: new vs old kernel"
SKIP_BUILD=1 OUT=$OUT/mla TEST_TIMEOUT=30 BENCH_TIMEOUT=80 timeout 170 tools/device/bench_mla_decode.sh > "$OUT/mla.log" 2>&1
echo "bench_mla_decode rc=$?" >> "$T"
grep -E "passed|FAILED|worst|^\|" "$OUT/mla.log" >> "$T"
}
step "done"
# the device tool brings back at most 8 files: the table, and everything else in one archive
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=session.txt -- * && find . -mindepth 1 ! -name all.tgz ! -name session.txt -delete)
cat "$T"
