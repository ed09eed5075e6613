#!/usr/bin/env bash
# Two lunar builds against each other on Kimi-Linear-48B decode (dummy weights), alternating rounds: for a
# change with no run-time switch (a refactor checked only by PTX, a reverted commit), built twice here.
# PREFILL=1: the 8K prefill instead (one sequence from empty caches, time_s of the bench's prefill row).
# MODEL: the model and its options (default Kimi-Linear-48B; e.g. "configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10").
#   P=<prebuilt dir: lib/> A=<lunar binary> B=<lunar binary> [BATCH=1] [ROUNDS=3] [PREFILL=1] [MODEL=...] OUT=<dir> \
#     tools/device/binab.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=binab.txt . tools/device/env.sh
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
for r in $(seq 1 "${ROUNDS:-3}"); do
  for v in A B; do
    bin=${!v}
    step "$v ($bin) round $r"
    if [ "${PREFILL:-0}" = 1 ]; then
      timeout 90 "$bin" bench ${MODEL:-configs/kimi-linear-48b-a3b.json} --load-format dummy --backend cuda --max-len 9000 \
        --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 > "$OUT/binab_${v}_$r.log" 2>&1
      echo "rc=$? prefill 8K: $(grep -A3 '^prefill' "$OUT/binab_${v}_$r.log" | awk '$1 ~ /^[0-9]+$/' | tr -s ' ' | head -1)" >> "$T"
      continue
    fi
    timeout 60 "$bin" bench ${MODEL:-configs/kimi-linear-48b-a3b.json} --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes "${BATCH:-1}" --contexts 1024 --steps 64 > "$OUT/binab_${v}_$r.log" 2>&1
    echo "rc=$? $(tpot "$OUT/binab_${v}_$r.log")" >> "$T"
  done
done
(cd "$OUT" && tar czf binab.tgz binab_*.log && rm -f binab_*.log)
cat "$T"
