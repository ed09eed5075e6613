#!/usr/bin/env bash
# One device call for the latent MoE (src/backend/cuda/cuda_moe.cu): build the CUDA runtime, dense
# ops and MoE sources for sm_90a with the CPU ops, run tests/test_cuda_moe.c (every MoE piece
# against the CPU ops), then its benchmarks (LUNAR_MOE_BENCH=1) and a PyTorch grouped-GEMM baseline
# (torch._grouped_mm, bf16 weights) when python3 has torch. Modelled on tools/device/check.sh.
#   tools/device/check_moe.sh [tests|bench|all]      (logs under $OUT when set)
# env: TORCH=0 skips the PyTorch baseline.
set -u
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-/tmp/lunar-check-moe}
mkdir -p "$OUT"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
CC=${CC:-cc}
B=build-device-moe
mkdir -p $B
ARCH='-gencode=arch=compute_90a,code=sm_90a'
CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wno-unused-parameter -fopenmp -Iinclude -Isrc -Itests -DLUNAR_HAVE_CUDA"
echo "== build ($NVCC, $(date +%T))"
t0=$(date +%s)
pids=()
for f in src/backend/cuda/cuda_rt.cu src/backend/cuda/cuda_device.cu src/backend/cuda/cuda_gemm.cu \
         src/backend/cuda/cuda_dense.cu src/backend/cuda/cuda_moe*.cu; do
  o=$B/$(basename "$f" .cu).cu.o
  "$NVCC" -std=c++17 -O3 $ARCH -Isrc -Iinclude -Xptxas -warn-spills -c "$f" -o "$o" > "$B/$(basename $f).log" 2>&1 &
  pids+=($!)
done
for f in src/backend/cpu/*.c src/base/err.c src/base/tensor.c tests/test_main.c tests/test_cuda_moe.c; do
  $CC $CFLAGS -c "$f" -o "$B/$(echo "$f" | tr / _).o" &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
cat $B/*.cu.log
[ $fail = 0 ] || { echo "BUILD FAILED"; exit 1; }
LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lpthread -lstdc++ -lm -fopenmp"
$CC -o $B/lunar_moe_tests $B/*.cu.o $B/src_backend_cpu_*.o $B/src_base_*.o $B/tests_test_main.c.o $B/tests_test_cuda_moe.c.o $LIBS || exit 1
echo "== built in $(( $(date +%s) - t0 )) s"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true

rc=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  echo "== MoE CUDA ops vs CPU ops ($(date +%T))"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 240 $B/lunar_moe_tests cuda_moe > "$OUT/tests_moe.log" 2>&1
  rc=$?
  grep -E "max rel err|FAILED|passed|CUDA error|internal error|Assert|requirement" "$OUT/tests_moe.log" | sed 's/^ *//'
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  echo "== lunar MoE benchmarks ($(date +%T))"
  LUNAR_MOE_BENCH=1 timeout 200 $B/lunar_moe_tests cuda_moe_bench 2>&1 | grep -v "^\[" | tee "$OUT/bench_moe.md"
  if [ "${TORCH:-1}" = 1 ] && python3 -c 'import torch' > /dev/null 2>&1; then
    echo "== PyTorch grouped GEMM baseline ($(date +%T)): torch._grouped_mm, bf16 weights, 146 rows/expert"
    PYTHONUNBUFFERED=1 timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/bench_torch.md"
import torch
print("torch", torch.__version__)
G, M = 128, 146            # experts, rows per expert (8192 tokens x 16 / 896)
for D, I in ((3584, 3072), (3584, 384)):
    x = torch.randn(G * M, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(G, 2 * I, D, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    w2 = torch.randn(G, D, I, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    h = torch.randn(G * M, I, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(M, G * M + 1, M, device="cuda", dtype=torch.int32)
    try:
        f = lambda: (torch._grouped_mm(x, w13, offs=offs), torch._grouped_mm(h, w2, offs=offs))
        for _ in range(3): f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); f(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort(); ms = ts[len(ts) // 2]
        fl = 2.0 * G * M * 3 * D * I
        print(f"| torch._grouped_mm bf16 D={D} I={I} | rows {G*M} | {ms:.3f} ms | {fl / ms / 1e9:.1f} TFLOP/s |")
    except Exception as e:
        print("torch._grouped_mm failed:", repr(e)[:300])
    del x, w13, w2, h
    torch.cuda.empty_cache()
PY
  fi
fi
echo "== done ($(date +%T)), tests rc=$rc"
exit $rc
