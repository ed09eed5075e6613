#!/usr/bin/env bash
# Session 16, the lead's last call (one H200): main after the session's merges (KDA intra tc the default, MXFP4
# decode path 16's interleaved k-splits at one token, MLA FP8 decode s10m the default, cuda_mla_wgmma.cu split):
#  1. tools/device/session.sh: check.sh tests (every CUDA op vs its CPU op, the goldens end to end, engine /
#     generate / serve on CUDA), the dummy loader and NCCL world-1 tests, the norm bench, issue 9's table
#     (Kimi-Linear-48B prefill 1K / 8K / 32K and decode B = 1 / 8 / 32 / 64; the K3.1 TP8 slice)
#  2. Kimi-Linear-48B 8K prefill, PF_ROUNDS more rounds (the MFU line of issue 9)
#   P=<prebuilt dir> OUT=<dir> bash tools/device/s16_call3.sh   (needs build-device/ from the pack's bd/)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
mkdir -p build-device && cp -a "$P"/bd/. build-device/
SERVE=0 CUDA_TP=0 INPUT_LENS=1024,8192,32768 BATCHES=1,8,32,64 CONTEXTS=1024 \
  BENCH_FLAGS="--max-len 36864 --steps 64" K31_INPUT_LENS=8192 K31_BATCHES=1,8,64 K31_CONTEXTS=8192 \
  OUT=$OUT/s bash tools/device/session.sh "$P" > /dev/null 2>&1
SUMMARY=prefill.txt . tools/device/env.sh
pre() { grep -A3 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s (%s MFU)  ", $1, $2, $6}'; echo; }
for r in $(seq 1 "${PF_ROUNDS:-2}"); do
  step "KL48 prefill 8K round $r"
  timeout 60 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
    --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 4 > $OUT/pf_$r.log 2>&1
  echo "rc=$? $(pre $OUT/pf_$r.log)" >> $T
done
step done
(cd "$OUT" && tar czf pf.tgz pf_*.log && rm -f pf_*.log)
cat $OUT/s/session.txt $T
