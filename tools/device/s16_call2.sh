#!/usr/bin/env bash
# Session 16, the lead's second call (one H200): the tensor-core KDA intra form (tc) as the default and the forward
# test's near-tie argmax rule, in order:
#  1. lunar_tests cuda_forward (every forward test, default = tc), then cuda_forward_k3_shapes under
#     LUNAR_KDA_INTRA=fast (the session-13 kernel): the "vs CPU" lines with the strict counts
#  2. lunar_tests cuda_kda_chunked (the KDA chunked op tests against the CPU op)
#  3. bench_cuda prefill2 (the default path, T = 8K / 64K, H = 96 / 32) and fla's chunk_kda on the same shapes
#     (device/wheels carried), ROUNDS rounds of lunar
#   P=<prebuilt dir: bin/, lib/, bd/bench_cuda> OUT=<dir> [ROUNDS=2] bash tools/device/s16_call2.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
for v in LUNAR_NONE=0:cuda_forward LUNAR_KDA_INTRA=fast:cuda_forward_k3_shapes LUNAR_NONE=0:cuda_kda_chunked; do
  f=${v#*:}; e=${v%%:*}
  step "lunar_tests $f $e"
  env $e OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_${f}_${e#*=}.log 2>&1; echo "rc=$?" >> $T
  grep -E 'vs CPU|FAILED|passed, ' $OUT/t_${f}_${e#*=}.log | sed 's/^ *//; s/bf16 operands), median\/worst row: //' |
    cut -c1-260 >> $T
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  step "bench_cuda prefill2 round $r"
  timeout 60 $P/bd/bench_cuda prefill2 > $OUT/pf2_$r.md 2>&1; echo "rc=$?" >> $T
  grep '^| kda prefill' $OUT/pf2_$r.md | cut -c1-150 >> $T
done
if ls device/wheels/*.whl > /dev/null 2>&1; then
  step "fla chunk_kda (same shapes)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site device/wheels/*.whl > /dev/null 2>&1
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-150} python3 tools/device/bench_fla.py prefill 2>&1 |
    grep -v Warning > $OUT/fla.md; echo "rc=$?" >> $T
  grep '^|' $OUT/fla.md | cut -c1-150 >> $T
fi
step done
(cd "$OUT" && tar czf logs.tgz t_*.log pf2_*.md fla.md 2> /dev/null; rm -f t_*.log pf2_*.md fla.md)
cat $T
