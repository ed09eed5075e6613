#!/usr/bin/env bash
# Session 9, task decb1 (issue 9: Kimi-Linear-48B decode at batch 1 towards 2.0 ms). One script per call:
#   P=<prebuilt dir> OUT=<dir> [NCU=1] [TESTS="cuda_forward ENV=V:cuda_forward ..."] [AB="ENV=V,ENV2=V ..."] \
#     [ROUNDS=2] [ONCE="ENV=V ..."] tools/device/decb1.sh
# ONCE: variants timed once each after the rounds. NCU=1: the per-kernel table of one eager B=1 step
# (NCU_ENV="ENV=V ..." its switches) (Nsight Compute, application replay, each kernel alone;
# tools/device/ncu_step.py). TESTS: lunar_tests filters, "ENV=V:filter" with those switches.
# AB: Kimi-Linear B=1 1K 64 steps, main's defaults then each variant, alternating, ROUNDS rounds.
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=decb1.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
timeout 20 nvidia-smi -q -d POWER,CLOCK > $OUT/power.txt 2>&1
grep -E 'Power Limit|^ +SM +:' $OUT/power.txt | head -3 >> $T
# TESTS: entries "filter" or "ENV=V,ENV2=V:filter" (the filter run with those switches)
for f in ${TESTS:-}; do
  v=LUNAR_NONE=0; case $f in *:*) v=${f%%:*}; f=${f#*:};; esac
  step "lunar_tests $f $v"
  env ${v//,/ } OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_tests $f > $OUT/t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|rel err' $OUT/t.log | cut -c1-200 | tail -6 >> $T
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-}; do
    i=$((i + 1))
    step "KL48 decode B=1 $v round $r"
    env ${v//,/ } timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
# ONCE: variants run once each after the rounds (diagnosis, not A/B)
for v in ${ONCE:-}; do
  step "KL48 decode B=1 $v once"
  env ${v//,/ } timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
    --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_once_${v%%=*}.log 2>&1
  echo "rc=$? $(tpot $OUT/ab_once_${v%%=*}.log)" >> $T
done
if [ "${NCU:-0}" = 1 ]; then
  step "ncu: one KL48 B=1 decode step, per kernel"
  env ${NCU_ENV:-LUNAR_NONE=0} timeout 110 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-count 3000 \
    $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 1024 --steps 1 \
    > $OUT/ncu_dec.csv 2> $OUT/ncu_dec.err
  echo "ncu rc=$?" >> $T; gzip $OUT/ncu_dec.csv; python3 tools/device/ncu_step.py $OUT/ncu_dec.csv.gz -3 > $OUT/ncu_table.md 2>&1
  head -40 $OUT/ncu_table.md >> $T
fi
step done
(cd "$OUT" && tar czf ab.tgz ab_*.log && rm -f ab_*.log t.log)
cat $T
