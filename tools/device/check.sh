#!/usr/bin/env bash
# One device call: build the CUDA backend for sm_90a, run every CUDA op against its CPU op, then
# the benchmarks (lunar, then fla side by side) and print a short table. Builds with nvcc and cc
# directly (no make, no jansson/pcre2: only the ops, base and CUDA sources are needed).
#   tools/device/check.sh [tests|bench|all]      (logs under $OUT when set)
# env: TESTS=filter (default cuda), BENCH='prefill decode gemm' (default all), FLA=0 skips fla, FLA_WHAT=decode|prefill|all,
#      FLA_TIMEOUT seconds (default 150; triton autotunes each new shape)
# fla wheels (downloaded on a networked machine: pip download flash-linear-attention fla-core
# --no-deps -d device/wheels) are installed from device/wheels when present.
set -u
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-/tmp/lunar-check}
mkdir -p "$OUT"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
CC=${CC:-cc}
B=build-device
mkdir -p $B
ARCH='-gencode=arch=compute_90a,code=sm_90a'
CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wno-unused-parameter -fopenmp -Iinclude -Isrc -Itests -DLUNAR_HAVE_CUDA"
echo "== build ($NVCC, $(date +%T))"
t0=$(date +%s)
pids=()
for f in src/backend/cuda/*.cu; do
  o=$B/$(basename "$f" .cu).cu.o
  "$NVCC" -std=c++17 -O3 $ARCH -Isrc -Iinclude -Xptxas -warn-spills -c "$f" -o "$o" > "$B/$(basename $f).log" 2>&1 &
  pids+=($!)
done
for f in src/backend/cpu/*.c src/base/err.c src/base/tensor.c tests/test_main.c tests/test_cuda_ops.c tools/device/bench_cuda.c; do
  $CC $CFLAGS -c "$f" -o "$B/$(echo "$f" | tr / _).o" &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
cat $B/*.cu.log
[ $fail = 0 ] || { echo "BUILD FAILED"; exit 1; }
LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lpthread -lstdc++ -lm -fopenmp"
COMMON=$(ls $B/*.cu.o $B/src_backend_cpu_*.o $B/src_base_*.o)
$CC -o $B/lunar_cuda_tests $COMMON $B/tests_test_main.c.o $B/tests_test_cuda_ops.c.o $LIBS || exit 1
$CC -o $B/bench_cuda $COMMON $B/tools_device_bench_cuda.c.o $LIBS || exit 1
echo "== built in $(( $(date +%s) - t0 )) s"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true

rc=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  echo "== CUDA ops vs CPU ops ($(date +%T))"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 $B/lunar_cuda_tests ${TESTS:-cuda} > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "max rel err|FAILED|ok$|passed|skipped|error" "$OUT/tests.log" | sed 's/^ *//' | awk '{print}' | tail -n 200 > "$OUT/tests_summary.log"
  grep -E "FAILED|passed|CUDA error|internal error" "$OUT/tests.log"
  echo "-- worst error per op family:"
  grep "max rel err" "$OUT/tests.log" | sed -E 's/^ *([a-z_]+( verify| \(tf32\)| \(no weight\)| \(no beta_l\)| \(bf16\))?).*max rel err ([0-9.e+-]+|inf) \(tol ([0-9e.+-]+)\).*/\1 \3 \4/' |
    awk '{n=$1; for(i=2;i<NF-1;i++) n=n" "$i; e=$(NF-1); t=$NF; if (!(n in m) || e+0 > m[n]+0) {m[n]=e; tt[n]=t}} END {for (n in m) printf "   %-28s %-10s tol %s\n", n, m[n], tt[n]}' | sort
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  echo "== lunar benchmarks ($(date +%T))"
  for w in ${BENCH:-all}; do $B/bench_cuda $w; done 2>&1 | tee "$OUT/bench_lunar.md"
  if [ "${FLA:-1}" = 1 ] && ls device/wheels/*.whl > /dev/null 2>&1; then
    echo "== fla ($(date +%T))"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site device/wheels/*.whl > /dev/null 2>&1
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-150} python3 tools/device/bench_fla.py ${FLA_WHAT:-all} 2>&1 | grep -v Warning | tee "$OUT/bench_fla.md"
  fi
fi
echo "== done ($(date +%T)), tests rc=$rc"
exit $rc
