#!/usr/bin/env bash
# Issue 8/9, session 8 (branch s8-mx4dec2): the MoE decode kernels' opt bits (LUNAR_MOE_DEC_OPT, unset
# = all = the new default; 0 = session 7's kernels) in one device call: the expert op tests (every
# decode path vs the CPU), the decode bench at batch 1 (K3.1 MXFP4 shapes + Kimi-Linear BF16) old vs
# new, lunar bench Kimi-Linear B=1,8 and the K3.1 TP8 slice B=1,8,64 old vs new alternating, the
# forward tests with the new default, then (time left) Nsight Compute on the BF16 pair at batch 1.
#   P=.xfer-NAME OUT=/tmp/o tools/device/mx4dec8.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4dec8.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe (new default)"
OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -12 >> $T
for o in 0 7; do
  step "decode1 bench LUNAR_MOE_DEC_OPT=$o"
  LUNAR_MOE_DEC_OPT=$o LUNAR_MOE_BENCH=decode1 timeout 40 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_$o.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| [KM]|Measured' $OUT/bench_$o.log >> $T
done
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K=configs/kimi-linear-48b-a3b.json
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in 1 2; do for o in 0 7; do
  left 100 || break
  step "KL48 B=1,8 LUNAR_MOE_DEC_OPT=$o round $r"
  LUNAR_MOE_DEC_OPT=$o timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
    --batch-sizes 1,8 --contexts 1024 --steps 64 > $OUT/kl_${o}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/kl_${o}_$r.log)" >> $T
done; done
for o in 0 7; do
  left 125 || break
  step "K3.1 slice LUNAR_MOE_DEC_OPT=$o"
  LUNAR_MOE_DEC_OPT=$o timeout 40 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8,64 --contexts 8192 > $OUT/k3_$o.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_$o.log)" >> $T
done
if left 140; then
  step "cuda_forward (new default)"
  OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -8 >> $T
fi
NCU="ncu --clock-control none --kernel-name-base demangled --section SpeedOfLight --section LaunchStats --metrics smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum,smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warps_issue_stalled_barrier_per_warp_active.pct"
for o in 0 7; do
  left 150 || break
  step "ncu BF16 pair at batch 1, LUNAR_MOE_DEC_OPT=$o"
  LUNAR_MOE_DEC_OPT=$o LUNAR_MOE_BENCH=decode1 timeout 40 $NCU -k regex:'moe_decode_kernel<.int.1, .bool.0' --launch-count 2 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_$o.txt 2>&1; echo "rc=$?" >> $T
  grep -E 'moe_decode_kernel<|Duration|DRAM Through|Grid Size|Waves Per SM|inst_executed|stalled|dram__bytes' $OUT/ncu_$o.txt | head -24 >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4dec8.txt -- * && rm -f t_* kl_* k3_* bench_* ncu_*)
cat $T
