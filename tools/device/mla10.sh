#!/usr/bin/env bash
# MLA decode, FP8 pages, round 10 (session 15; issue 7). Round 7's ncu found the st kernel's tile loop bound by its
# instruction stream's dependencies (tensor pipe 39 % active); its one wgmma wait a tile retires S(it) and PV(it - 1)
# together, so PV was never overlapped. Variants of the default (s9 below 512K rows x context where the merge goes
# into the kernel, s9c elsewhere): =s10 the default's choice with PV(it - 1) in flight past the tile's top wait (the
# tiles in pairs), =s10a s9 with it (q first and the merge in the kernel wherever the merge fits), =s10m s10a with
# the merge's partial-O loads batched. In order: the wgmma op test's round-10 runs (memcmp-equal to stlp),
# bench_mla fp8trace (s9 / s10a / s10m, L2 flushed: per tile, merge), bench_mla fp8ab (4 rotated rounds) at the
# issue's four shapes and B = 8, 8K, Kimi-Linear's FP8 TPOT (B = 8 / 64 at 32K) alternating default / =s10, then
# ncu (application replay, one launch at H = 32, B = 64, 8K) of the default and =s10, and the whole wgmma op test
# (every kernel on the new 64-row case) while time is left.
#   P=<dir with bin/ (lunar), bd/ (lunar_cuda_tests, bench_mla of build-device) and lib/> OUT=... tools/device/mla10.sh
# (Run at ac4787f, copied into the pack: tar xJf .xfer-mla10z/pack.tar.xz && P=.xfer-mla10 OUT=$OUT bash .xfer-mla10/mla10.sh;
# 110 s of command; the last step, the whole wgmma op test, ran out of its 45 s.)
set -u
P=${P:-.xfer-mla10}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
step "lunar_cuda_tests cuda_mla_wgmma, round 10's runs (memcmp-equal to stlp)"
LUNAR_TEST_MLA_FP8="s10a s10m" LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 \
  ${BD:-$P/bd}/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
grep -E "round 10" $OUT/t_mla.log | grep fp8 | sed 's/^ *//' | cut -c1-130 | sort | uniq -c | head -24 >> $T
grep -E "mla wgmma decode:.*(PV in flight|batched)" $OUT/t_mla.log | sort | uniq -c | cut -c1-240 >> $T
step "bench_mla fp8trace (s9, s10a, s10m; L2 flushed)"
BENCH_MLA_AB="s9 s10a s10m" BENCH_MLA_L2MODES=flush timeout ${TRACE_TIMEOUT:-40} ${BD:-$P/bd}/bench_mla fp8trace > $OUT/trace.md 2>&1
echo "rc=$?" >> $T
grep '^|' $OUT/trace.md >> $T
step "bench_mla fp8ab (default s10 s10a s10m)"
BENCH_MLA_AB="default s10 s10a s10m" BENCH_MLA_CASES="32 64 32768;32 8 131072;32 64 8192;32 8 32768;32 8 8192" \
  timeout ${AB_TIMEOUT:-60} ${BD:-$P/bd}/bench_mla fp8ab > $OUT/fp8ab.md 2>&1
echo "rc=$?" >> $T
grep '^|' $OUT/fp8ab.md >> $T
K=configs/kimi-linear-48b-a3b.json
step "TPOT: default vs =s10"
for round in 1 2 3; do
  for v in def s10; do
    [ $(( $(date +%s) - t0 )) -gt ${TPOT_BEFORE:-90} ] && { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
    [ $round = 1 ] && grep -m3 "heads as N" $OUT/b.log | cut -c1-220 >> $T
    [ $round = 1 ] && [ $v = s10 ] && cp $OUT/b.log $OUT/b_s10.log
  done
done
for v in def s10; do
  [ $(( $(date +%s) - t0 )) -gt ${NCU_BEFORE:-130} ] && { echo "skip ncu $v (time)" >> $T; continue; }
  step "ncu $v (H = 32, B = 64, 8K, one launch, application replay)"
  case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
  env $e BENCH_MLA_CASE="32 64 8192" timeout 40 ncu --clock-control none --replay-mode application --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats \
    --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
    --page raw -k regex:wgmma_decode_st --launch-skip 1 --launch-count 1 ${BD:-$P/bd}/bench_mla fp8one > $OUT/ncu_$v.txt 2>&1
  echo "rc=$?" >> $T
  grep -E "fp8one|gpu__time_duration.sum |smsp__average_warps_issue_stalled_.*_per_issue_active.ratio |gmma|inst_executed.sum |issue_active.avg.pct|pipe_.*pct_of_peak_sustained_active |ERROR" \
    $OUT/ncu_$v.txt | sed 's/  */ /g' | cut -c1-120 | head -60 >> $T
done
if [ $(( $(date +%s) - t0 )) -lt ${FULL_BEFORE:-150} ]; then
  step "lunar_cuda_tests cuda_mla_wgmma, every run (the 64-row case under each kernel)"
  OMP_NUM_THREADS=16 timeout 45 ${BD:-$P/bd}/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_full.log 2>&1
  echo "rc=$?" >> $T
  grep -E "passed|failed|FAIL|CHECK" $OUT/t_full.log | sort | uniq -c | cut -c1-170 >> $T
fi
step done
(cd $OUT && tar czf logs.tgz t_mla.log t_full.log b.log b_s10.log ncu_def.txt ncu_s10.txt 2>/dev/null &&
  rm -f b.log t_mla.log t_full.log b_s10.log ncu_def.txt ncu_s10.txt)
cat $T
