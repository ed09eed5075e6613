#!/usr/bin/env bash
# llama.cpp's Kimi-Linear support as issue 9's peer, on the device, in one call: a random-weight GGUF of the full
# Kimi-Linear-48B-A3B shapes (tools/device/llamacpp_dummy_gguf.py, Q4_0 by default), then llama-bench: prefill at
# 1K and 8K, decode of 64 tokens at batch 1 after a 1K context, flash attention on, everything on the GPU.
# llama-bench is built HERE (outside the repository) from llama.cpp's source, for sm_90a, and carried in:
#   cmake -S <llama.cpp> -B /tmp/lcp-build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=OFF \
#     -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
#     -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release && ninja -C /tmp/lcp-build llama-bench
#   LLAMA_BENCH=<carried llama-bench> [GGUF_TYPE=q4_0|q8_0] OUT=<dir> tools/device/peer_llamacpp.sh
# (Written in session 7 and not yet run on the device: llama.cpp's CUDA build, ~190 nvcc files, did not finish on
# the 2 shared cores within the session. The GGUF writer was checked here on a toy config with gguf-py's reader.
# Start the build at the very beginning of a session, niced, outside the repository.)
set -u
OUT=${OUT:-/tmp/o}
mkdir -p "$OUT"
LB=${LLAMA_BENCH:?path of llama-bench}
TYPE=${GGUF_TYPE:-q4_0}
G=/tmp/kl48-$TYPE.gguf
df -h /tmp | tail -1
t0=$(date +%s)
timeout 240 python3 tools/device/llamacpp_dummy_gguf.py configs/kimi-linear-48b-a3b.json "$G" --type "$TYPE" 2>&1
echo "gguf rc=$? in $(( $(date +%s) - t0 )) s"
"$LB" --help 2>&1 | grep -E '^\s+-(d|fa|ub)' | head -5
# one invocation (the model loads once): prefill 1K and 8K from an empty context, decode of 64 tokens at batch 1
# from empty and after a 1K context (as lunar bench --contexts 1024); -r 3 repetitions (mean +- sd)
timeout 400 "$LB" -m "$G" -ngl 99 -fa 1 -p 1024,8192 -n 64 -d 0,1024 -r 3 -o md 2>&1 | tee "$OUT/llamacpp.md"
echo "llama-bench rc=${PIPESTATUS[0]}"
rm -f "$G"
