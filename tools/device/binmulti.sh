#!/usr/bin/env bash
# Several lunar builds against each other on Kimi-Linear-48B decode at B=1 (dummy weights), every build once a round,
# rounds alternating: a bisection of a regression between commits, each built here.
#   P=<prebuilt dir: lib/> BINS="<lunar binary> ..." [ROUNDS=3] [BATCH=1] OUT=<dir> tools/device/binmulti.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=binmulti.txt . tools/device/env.sh
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s", $3}'; }
for r in $(seq 1 "${ROUNDS:-3}"); do
  for bin in $BINS; do
    timeout 60 "$bin" bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes "${BATCH:-1}" --contexts 1024 --steps 64 > "$OUT/bm.log" 2>&1
    echo "round $r rc=$? $(basename "$bin") $(tpot "$OUT/bm.log") ms" >> "$T"
  done
done
step done
# the mean of each build over the rounds
awk '{s[$4] += $5; n[$4]++} END {for (b in s) printf "mean %s %.3f ms (%d rounds)\n", b, s[b] / n[b], n[b]}' \
  <(grep '^round' "$T") | sort -k3 -n >> "$T"
cat "$T"
