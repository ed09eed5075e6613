#!/usr/bin/env bash
# Issue 9 (written in session 15, not yet run: no device time was left): the output projection's weights asked
# into L2 by extra blocks of the KDA conv launch (LUNAR_KDA_CONV_PF=<blocks>, LUNAR_KDA_CONV_PF_KB=<request KB>),
# no forked kernel, no graph edge. In one call:
#  1. lunar_tests cuda_kda_conv_qkv_decode (the plain op vs the CPU op; the prefetching launch memcmp-equal to it)
#     and cuda_forward (defaults), then cuda_forward_graphs with the switch on (graphs == eager, goldens)
#  2. Kimi-Linear-48B B = 1, 1K, 64 steps: the default and each AB variant, ROUNDS rounds alternating
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=3] [AB="LUNAR_KDA_CONV_PF=64 ..."] [BUDGET=120] bash tools/device/convpf.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=convpf.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
left() { [ $(( $(date +%s) - t0 )) -lt "${BUDGET:-120}" ]; }
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
for f in cuda_kda_conv_qkv_decode cuda_forward LUNAR_KDA_CONV_PF=64:cuda_forward_graphs; do
  v=LUNAR_NONE=0; case $f in *:*) v=${f%%:*}; f=${f#*:};; esac
  step "lunar_tests $f $v"
  env $v OMP_NUM_THREADS=16 timeout 100 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|differ' $OUT/t_$f.log | cut -c1-200 | tail -6 >> $T
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${AB:-LUNAR_KDA_CONV_PF=32 LUNAR_KDA_CONV_PF=64 LUNAR_KDA_CONV_PF=132,LUNAR_KDA_CONV_PF_KB=4}; do
    i=$((i + 1)); left || break
    step "KL48 B=1 $v round $r"
    env ${v//,/ } timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
step done
(cd "$OUT" && tar czf ab.tgz ab_*.log t_*.log && rm -f ab_*.log t_*.log)
cat $T
