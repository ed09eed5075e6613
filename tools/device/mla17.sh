#!/usr/bin/env bash
# MLA decode, FP8 pages, session 17 (issue 7: B = 64, 8K >= 70 % of the latent bytes' floor; B = 8, 32K as far as it
# goes). Against the default (s10m): =s17l, the split-K merge by the row's last-arriving block from its registers
# where a row has 2 to 4 splits (rs::kXLm), elsewhere the in-kernel merge with its partial O loads before the
# weights' (rs::kXMe); =s17c, a row's splits as one cluster and the merge through distributed shared memory (rs::kXCl,
# 2 to 16 splits where all clusters fit at once; s17l's choice elsewhere). In order (each optional step only while
# the elapsed time allows):
#  1. lunar_cuda_tests cuda_mla_wgmma for s10m, s17l, s17c (both memcmp-equal to s10m; 2, 3, 4, 8, 16, 24, 32 splits);
#  2. bench_mla fp8ab default / s17l / s17c, BENCH_MLA_TIMING=dev, 4 rotated rounds, the issue's 5 shapes;
#  3. bench_mla fp8trace s10m / s17l / s17c (L2 flushed, dev timing): where the tail's time went;
#  4. lunar_tests cuda_forward under LUNAR_MLA_WGMMA_FP8=${FWD_V:-s17c};
#  5. Kimi-Linear-48B FP8 TPOT at B = 8 / 64, 8K: default / =s17l / =s17c, ROUNDS rounds, the order rotated (only on
#     a card with more than 100 GB: the BF16 dummy weights are ~96 GB), while the elapsed time < TPOT_BEFORE.
#   P=<dir with bin/ (lunar, lunar_tests), bd/ (lunar_cuda_tests, bench_mla of build-device) and lib/> OUT=... \
#     tools/device/mla17.sh
set -u
P=${P:-.xfer-mla}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
BD=${BD:-$P/bd}
K=configs/kimi-linear-48b-a3b.json
before() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)

step "op test cuda_mla_wgmma (s10m s17l s17c)"
LUNAR_TEST_MLA_FP8="s10m s17l s17c" LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 \
  timeout ${TEST_TIMEOUT:-80} $BD/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
echo "$(grep -c "max rel err" $OUT/t_mla.log) runs reported; worst: $(grep -oE "fp8 max rel err [0-9.e-]+" $OUT/t_mla.log |
  sort -t' ' -k5 -g | tail -1)" >> $T
grep -oE "mla wgmma decode: .*" $OUT/t_mla.log | sort | uniq -c | cut -c1-240 >> $T

CASES="32 64 32768;32 8 131072;32 64 8192;32 8 32768;32 8 8192"
step "bench_mla fp8ab default s17l s17c (device timing)"
LUNAR_MLA_WGMMA_VERBOSE=1 BENCH_MLA_TIMING=dev BENCH_MLA_AB="default s17l s17c" BENCH_MLA_CASES="$CASES" timeout 60 \
  $BD/bench_mla fp8ab > $OUT/fp8ab.md 2>&1
echo "rc=$?" >> $T
grep -E '^\||^###' $OUT/fp8ab.md | grep -v -- '---' >> $T
grep -oE "mla wgmma decode: .*" $OUT/fp8ab.md | sort | uniq -c | cut -c1-240 >> $T

step "bench_mla fp8trace s10m s17l s17c (L2 flushed, device timing)"
BENCH_MLA_TIMING=dev BENCH_MLA_AB="s10m s17l s17c" BENCH_MLA_L2MODES=flush timeout 45 $BD/bench_mla fp8trace > $OUT/trace.md 2>&1
echo "rc=$?" >> $T
grep -E '^\||^\(BENCH' $OUT/trace.md | grep -v -- '---' >> $T

step "lunar_tests cuda_forward under LUNAR_MLA_WGMMA_FP8=${FWD_V:-s17c}"
LUNAR_MLA_WGMMA_FP8=${FWD_V:-s17c} OMP_NUM_THREADS=16 timeout ${FWD_TIMEOUT:-40} $P/bin/lunar_tests cuda_forward > $OUT/fwd.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL" $OUT/fwd.log | tail -12 | cut -c1-200 >> $T

if [ "${MEM:-0}" -gt 100000 ]; then
  step "TPOT Kimi-Linear FP8, 8K: default / s17l / s17c, ${ROUNDS:-3} rounds, the order rotated"
  VV=(def s17l s17c)
  for round in $(seq 1 ${ROUNDS:-3}); do
    for k in 0 1 2; do
      v=${VV[$(( (round + k) % 3 ))]}
      before ${TPOT_BEFORE:-175} || { echo "skip TPOT $round $v (time)" >> $T; continue; }
      case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
      env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 45 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
        --batch-sizes 8,64 --contexts 8192 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
      echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
      [ $round = 1 ] && grep -m4 "heads as N" $OUT/b.log | cut -c1-240 >> $T
      [ $round = 1 ] && cp $OUT/b.log $OUT/b_$v.log
    done
  done
else
  echo "skip TPOT: ${MEM:-?} MiB on the card (Kimi-Linear BF16 dummy weights ~96 GB)" >> $T
fi

step done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1
# the summary last: the fp8ab means per shape, the TPOT rounds
{
  echo "## summary"
  grep -E '^\| 32 ' $OUT/fp8ab.md | cut -c1-300
  grep -E '^round ' $T | cut -c1-160
} >> $T
(cd $OUT && tar czf logs.tgz t_mla.log b_*.log fwd.log 2>/dev/null && rm -f t_mla.log b.log b_*.log fwd.log)
cat $T
