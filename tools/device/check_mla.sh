#!/usr/bin/env bash
# One device call for the MLA / DSA kernels (cuda_mla.cu, cuda_dsa.cu), modelled on check.sh:
# build for sm_90a with nvcc and cc directly (only the runtime, the MLA/DSA sources, the CPU ops and
# base), run tests/test_cuda_mla.c against the CPU ops, then tools/device/bench_mla.c; short tables.
#   tools/device/check_mla.sh [tests|bench|all]   (logs under $OUT when set)
# env: BENCH='decode sparse indexer' (default all), TEST_TIMEOUT / BENCH_TIMEOUT seconds (150 / 150)
set -u
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-/tmp/lunar-check-mla}
mkdir -p "$OUT"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
CC=${CC:-cc}
B=build-device-mla
mkdir -p $B
ARCH='-gencode=arch=compute_90a,code=sm_90a'
CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wno-unused-parameter -fopenmp -Iinclude -Isrc -Itests -DLUNAR_HAVE_CUDA"
echo "== build ($NVCC, $(date +%T))"
t0=$(date +%s)
pids=()
for f in src/backend/cuda/cuda_rt.cu src/backend/cuda/cuda_device.cu src/backend/cuda/cuda_mla.cu src/backend/cuda/cuda_dsa.cu; do
  o=$B/$(basename "$f" .cu).cu.o
  "$NVCC" -std=c++17 -O3 $ARCH -Isrc -Iinclude -Xptxas -v,-warn-spills -c "$f" -o "$o" > "$B/$(basename $f).log" 2>&1 &
  pids+=($!)
done
for f in src/backend/cpu/*.c src/base/err.c src/base/tensor.c tests/test_main.c tests/test_cuda_mla.c tools/device/bench_mla.c; do
  $CC $CFLAGS -c "$f" -o "$B/$(echo "$f" | tr / _).o" &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
grep -hE "error|warning|registers|spill" $B/*.cu.log | grep -B0 -E "error|warning|[1-9][0-9]* bytes spill|registers" | sort | uniq -c | head -20
[ $fail = 0 ] || { cat $B/*.cu.log | grep -A3 error; echo "BUILD FAILED"; exit 1; }
LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lpthread -lstdc++ -lm -fopenmp"
COMMON=$(ls $B/*.cu.o $B/src_backend_cpu_*.o $B/src_base_*.o)
$CC -o $B/lunar_mla_tests $COMMON $B/tests_test_main.c.o $B/tests_test_cuda_mla.c.o $LIBS || exit 1
$CC -o $B/bench_mla $COMMON $B/tools_device_bench_mla.c.o $LIBS || exit 1
echo "== built in $(( $(date +%s) - t0 )) s"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true

rc=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  echo "== MLA / DSA kernels vs CPU ops ($(date +%T))"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout ${TEST_TIMEOUT:-150} $B/lunar_mla_tests cuda > "$OUT/tests_mla.log" 2>&1
  rc=$?
  grep -E "max rel err|dsa indexer|FAILED|passed|CUDA error|requirement|differ|ok$" "$OUT/tests_mla.log" | sed 's/^ *//'
  [ $rc = 124 ] && echo "TESTS TIMED OUT"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  echo "== benchmarks ($(date +%T))"
  for w in ${BENCH:-all}; do timeout ${BENCH_TIMEOUT:-150} $B/bench_mla $w; done 2>&1 | tee "$OUT/bench_mla.md"
fi
echo "== done ($(date +%T)), tests rc=$rc"
exit $rc
