#!/usr/bin/env bash
# One device call for the KDA prefill kernels: build (sm_90a), the KDA CUDA-vs-CPU tests, lunar's
# prefill benchmarks (modes 2 = default, 3 = older intra kernel, 1 = 3xTF32) with a cross-check
# of the modes at two benchmark sizes, ncu on one call of each bf16 intra kernel, then fla's
# chunk_kda on the same shapes (last: triton autotunes each shape, ~3 minutes). Logs under $OUT.
#   tools/device/bench.sh            env: FLA=0 skips fla, NCU=0 skips ncu, TESTS=filter (cuda_kda)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/lunar-bench}
mkdir -p "$OUT"
BUILD_ONLY=1 tools/device/check.sh > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
grep -E "built in|error|spill" "$OUT/build.log" | grep -v " 0 bytes spill" | head -20
B=build-device
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
echo "== tests ($(date +%T))"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 $B/lunar_cuda_tests ${TESTS:-cuda_kda} > "$OUT/tests.log" 2>&1
rc=$?
grep -E "max rel err" "$OUT/tests.log" | sed -E 's/^ *//' | awk '{e=$0; sub(/.*max rel err /, "", e); split(e, a, " "); n=$0; sub(/ T=.*/, "", n); if (!(n in m) || a[1]+0 > m[n]+0) m[n]=a[1]} END {for (n in m) printf "   worst %-28s %s\n", n, m[n]}' | sort
grep -E "FAILED|passed|CUDA error|internal error" "$OUT/tests.log"
echo "== lunar prefill ($(date +%T))"
$B/bench_cuda prefill 2>&1 | tee "$OUT/bench_lunar.md"
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  echo "== ncu ($(date +%T))"
  timeout 150 ncu --clock-control none -k regex:kda_ --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    $B/bench_cuda profile > "$OUT/ncu.txt" 2>&1
  grep -E "kda_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Memory Throughput|Compute \(SM\) Th|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|Stall|Dynamic Shared" "$OUT/ncu.txt" | head -80
fi
if [ "${FLA:-1}" = 1 ] && ls device/wheels/*.whl > /dev/null 2>&1; then
  echo "== fla ($(date +%T))"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site device/wheels/*.whl > /dev/null 2>&1
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-200} python3 tools/device/bench_fla.py prefill 2>&1 | grep -v Warning | tee "$OUT/bench_fla.md"
fi
echo "== done ($(date +%T)), tests rc=$rc"
exit $rc
