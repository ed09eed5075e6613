#!/usr/bin/env bash
# s6-moedec2 call: the pair's MXFP4 copy rings 1-3 (paths 13-15): op tests, decode bench (pair / v2 /
# fused / rings), Nsight Compute on the K3.1 batch-1 gate/up kernel (ring 0 vs 1), K3.1 TP8 slice
# lunar bench by env. Every step's timeout is capped by a whole-script deadline of DL seconds.
set -u
P=${P:-.xfer-moedec7}
OUT=${OUT:-/tmp/o}
DL=${DL:-62}
SUMMARY=s.txt . tools/device/env.sh
L=$OUT/l; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
# to SEC: min(SEC, DL - elapsed), 0 when none is left
to() { local l=$(( DL - $(el) )); [ "$l" -lt "$1" ] && echo $(( l > 0 ? l : 0 )) || echo "$1"; }
run_to() { local s; s=$(to "$1"); shift; [ "$s" -lt 3 ] && { echo "skipped (t=$(el))" >> $T; return 1; }; timeout "$s" "$@"; }
nvidia-smi -L >> $T
step "op tests cuda_moe_experts_mxfp4 (every decode path incl. rings vs the CPU)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 run_to 22 stdbuf -oL -eL $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $L/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAIL|passed, ' $L/t_moe.log | cut -c1-170 | tail -12 >> $T
grep -E 'ring' $L/t_moe.log | awk '{print $(NF-2), $0}' | sort -g | tail -3 | cut -c1-170 >> $T
echo "ring lines: $(grep -cE 'ring' $L/t_moe.log)" >> $T
step "decode bench"
LUNAR_MOE_BENCH=decode run_to 24 stdbuf -oL -eL $P/bin/lunar_tests cuda_moe_bench > $L/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||Measured' $L/bench.log >> $T
ncu_ring() {
  step "ncu ring $1 (K3.1 n=1 gate/up)"
  LUNAR_MOE_BENCH=decode1 run_to 10 ncu --clock-control none --kernel-name-base mangled \
    -k regex:_Z17moe_decode_kernelILi1ELb1ELb1ELi4ELi${1}E --launch-count 1 --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats \
    $P/bin/lunar_tests cuda_moe_bench > $L/ncu_$1.txt 2>&1; echo "rc=$?" >> $T
  grep -E 'Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Block Limit|Dynamic Shared' $L/ncu_$1.txt | head -22 >> $T
}
ncu_ring 0
ncu_ring 1
K3="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 8192"
for d in pair ring8 ring5b; do
  step "K3.1 slice LUNAR_MOE_DECODE=$d"
  LUNAR_MOE_DECODE=$d run_to 14 $K3 > $L/k3_$d.txt 2>&1; echo "rc=$?" >> $T
  sed -n '/^decode/,$p' $L/k3_$d.txt | head -8 >> $T; grep -iE 'error|abort|fail' $L/k3_$d.txt | head -4 >> $T
done
ncu_ring 2
step done
cp $L/bench.log $OUT/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT l && rm -rf $L
cat $T
