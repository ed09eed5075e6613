#!/usr/bin/env bash
# Session 15, the lead's call (one H200): main after the session's merges (s15-kdai3: the KDA intra kernel on tensor
# cores by default; s15-mla10: MLA FP8 decode round 10, opt-in) and the L2 prefetch (LUNAR_L2PF, opt-in), in order:
#  1. tools/device/l2pf.sh: the prefetch bench, op tests (TESTS: the prefetch, the forward with the new KDA
#     default and the prefetch's bit-equality, the KDA chunked ops, the MLA wgmma decode), Kimi-Linear B = 1 A/B
#     rounds of the prefetch bits, B = 8, the K3.1 slice
#  2. Kimi-Linear-48B prefill 1K / 8K: the default (tc intra) against LUNAR_KDA_INTRA=fast, PF_ROUNDS rounds
#   P=<prebuilt dir> OUT=<dir> [BUDGET=...] [PF_ROUNDS=2] bash tools/device/s15_final.sh   (l2pf.sh's knobs pass through)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
bash tools/device/l2pf.sh > /dev/null 2>&1
SUMMARY=prefill.txt . tools/device/env.sh
pre() { grep -A3 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s (%s MFU)  ", $1, $2, $6}'; echo; }
for r in $(seq 1 "${PF_ROUNDS:-2}"); do
  for v in LUNAR_NONE=0 LUNAR_KDA_INTRA=fast; do
    step "KL48 prefill 1K/8K $v round $r"
    env $v timeout 90 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
      --max-len 9000 --input-lens 1024,8192 --batch-sizes 1 --contexts 1024 --steps 4 > $OUT/pf_${v%%=*}_$r.log 2>&1
    echo "rc=$? $(pre $OUT/pf_${v%%=*}_$r.log)" >> $T
  done
done
step done
(cd "$OUT" && tar czf pf.tgz pf_*.log && rm -f pf_*.log)
cat $OUT/l2pf.txt $T
