#!/usr/bin/env bash
# Session 9, issue 7 (branch s9-kdapre): mode 2's KDA state pass, kda_state_bf16_kernel against the
# warp-specialised kda_state_ws_kernel (LUNAR_KDA_STATE=ws) and the staged kda_state_pipe_kernel
# (=pipe|pipe2). The KDA op tests (CUDA vs CPU, the new passes bit-equal to the old one; nothing
# else runs if they fail), bench_cuda kdastate (H = 32, T = 8K / 64K, old / ws / pipe3 alternating,
# two rounds), with MODEL=1 the Kimi-Linear 8K prefill A/B (--profile: kda_core), ncu on the chunk
# kernels at H = 32 (T = 8K), and with FLA=1 fla's chunk_kda.
#   P=<prebuilt dir> OUT=<dir> [MODEL=1] [NCU=0] [FLA=1] tools/device/kdapre.sh
set -u
P=${P:-.xfer-kdapre}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
B=build-device
K=configs/kimi-linear-48b-a3b.json
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> $T
step "lunar_cuda_tests cuda_kda"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $B/lunar_cuda_tests cuda_kda > $OUT/t_kda.log 2>&1; rc=$?; echo "rc=$rc" >> $T
grep -E 'FAILED|passed, |CHECK|CUDA error' $OUT/t_kda.log | cut -c1-160 | tail -12 >> $T
grep -E 'kda_chunked \(bf16\) T=(1000|333) H=(32|33|3) ' $OUT/t_kda.log | cut -c1-120 | tail -8 >> $T
[ $rc = 0 ] || { step "tests failed: stop"; cat $T; exit 1; }
step "bench_cuda kdastate"
timeout 60 $B/bench_cuda kdastate > $OUT/b_state.md 2>&1; echo "rc=$?" >> $T
grep -E '^\| kda' $OUT/b_state.md >> $T
if [ "${MODEL:-0}" = 1 ]; then
  pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
    awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(kda_proj|kda_core|kda_out|experts)$/ {printf "%s %s; ", $1, $2}' "$1"; }
  bench() { local n=$1 e=$2; shift 2
    env $e timeout 45 $P/bin/lunar bench $K --load-format dummy --backend cuda "$@" > $OUT/b_$n.log 2>&1
    echo "rc=$? $n [$e]: $(pre $OUT/b_$n.log)" >> $T; }
  for r in 1 2; do
    step "model A/B round $r"
    bench new_$r LUNAR_KDA_STATE=ws --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 --profile
    bench old_$r LUNAR_KDA_STATE=old --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 --profile
  done
fi
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  step "ncu (H = 32, T = 8192)"
  timeout 60 ncu --clock-control none -k regex:'kda_(intra2|state)' --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters $B/bench_cuda profile32 > $OUT/ncu.txt 2>&1
  echo "ncu rc=$?" >> $T
  grep -E "  kda_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|Compute \(SM\) Th|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Pipes Busy|Dynamic Shared" $OUT/ncu.txt | cut -c1-110 >> $T
  grep -E "Stall|stall" $OUT/ncu.txt | cut -c1-200 | head -30 > $OUT/ncu_stall.txt
fi
if [ "${FLA:-0}" = 1 ] && ls device/wheels/*.whl > /dev/null 2>&1; then
  step "fla chunk_kda"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site device/wheels/*.whl > /dev/null 2>&1
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-150} python3 tools/device/bench_fla.py prefill 2>&1 | grep -v Warning > $OUT/fla.md
  grep -E '^\|' $OUT/fla.md >> $T
fi
step done
cat $T
