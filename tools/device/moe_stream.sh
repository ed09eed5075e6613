#!/usr/bin/env bash
# Session 12, issue 9 (branch s12-klb1): the BF16 MoE decode pair streamed through shared-memory rings
# (LUNAR_MOE_STREAM, cuda_moe.cu's moe_stream_kernel; left out of the tree: needs the binaries of cda4dfa (round 1)
# or 4ce4453 (round 2); docs/benchmarks.md "Decode B = 1: the BF16 MoE pair (session 12, H200)").
# In order, each step only while time is left:
#  1. lunar_tests cuda_moe_stream (memcmp-equal to the pair, within 1e-2 of the CPU op) [and $TESTS]
#  2. Kimi-Linear-48B decode B = 1 and 8 (1K context, 64 steps), the default against each of $AB
#     (space-separated; a variant's assignments comma-separated), $ROUNDS rounds alternating
#  3. Nsight Compute on the op test's Kimi-Linear case (one token, 8 experts, D 2304, I 1024; each kernel
#     alone, L2 flushed): the pair's kernels and the streamed ones (launches: 0-3 the pair twice, 4-7
#     down streamed, 8-11 gate/up streamed), sections SpeedOfLight, Occupancy, LaunchStats,
#     WarpStateStats, SourceCounters + DRAM bytes; the raw CSV and details page come back (all.tgz)
#   P=<prebuilt dir> OUT=<dir> [AB=...] [ROUNDS=3] [NCU=1] [NCU_SECTIONS="--section ..."] [BUDGET=130] tools/device/moe_stream.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=moe_stream.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
K=configs/kimi-linear-48b-a3b.json
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader >> $T 2>&1
for f in cuda_moe_stream ${TESTS:-}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 45 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; rc=$?; echo "rc=$rc" >> $T
  # a failing or hanging streamed kernel: no timing rounds with it
  [ $f = cuda_moe_stream ] && [ $rc -ne 0 ] && AB=LUNAR_NONE=1 NCU=0
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -6 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-LUNAR_MOE_STREAM=1 LUNAR_MOE_STREAM=3}; do
    i=$((i + 1))
    left $(( ${BUDGET:-130} - 40 )) || break
    step "KL48 B=1,8 ctx 1K $v round $r"
    env ${v//,/ } timeout 20 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1,8 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
if [ "${NCU:-1}" = 1 ] && left $(( ${BUDGET:-130} - 25 )); then
  step "ncu: the pair and the streamed kernels, Kimi-Linear's op-test case"
  timeout 60 ncu --clock-control none -k regex:'moe_decode_kernel|moe_stream_kernel' --launch-count 12 --kill yes \
    ${NCU_SECTIONS:---section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters} \
    --metrics dram__bytes_read.sum,launch__grid_size -o $OUT/rep -f $P/bin/lunar_tests cuda_moe_stream > $OUT/ncu.log 2>&1
  echo "rc=$?" >> $T; tail -2 $OUT/ncu.log >> $T
  ncu -i $OUT/rep.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  ncu -i $OUT/rep.ncu-rep --page details > $OUT/det.txt 2>&1
  ncu -i $OUT/rep.ncu-rep --page details --csv > $OUT/det.csv 2>&1
  grep -E '^  moe_|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Grid Size|Warp Cycles Per Issued' $OUT/det.txt \
    | sed 's/(anonymous namespace):://' | cut -c1-110 | head -84 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=moe_stream.txt -- * && rm -rf t_* ab_* ncu.log raw.csv det.* rep.ncu-rep)
cat $T
