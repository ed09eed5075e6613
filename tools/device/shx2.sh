#!/usr/bin/env bash
# Session 14 (s14-shx), second call: alternating rounds of the 1K / 8K / 32K prefill, LUNAR_MOE_SHROW=0 (side
# stream) vs =1 (the shared expert as routed row E), none started after AB_S seconds.
#   P=<prebuilt dir> OUT=<dir> [AB_S=60] tools/device/shx2.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
for r in $(seq 1 20); do
  for v in 0 1; do
    [ $(( $(date +%s) - t0 )) -gt ${AB_S:-60} ] && break 2
    LUNAR_MOE_SHROW=$v timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 33000 \
      --input-lens 1024,8192,32768 --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/p_${v}_$r.log 2>&1
    echo "rc=$? round $r [$v]: $(awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6}' $OUT/p_${v}_$r.log | tr '\n' ' ')" >> $T
  done
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -rf p_*)
cat $T
