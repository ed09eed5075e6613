#!/usr/bin/env bash
# Session 16, the lead's first call (one H200), binaries of branch s16-exp (session 15's two unrun experiments
# brought back: the KDA intra accuracy forms of ff40fd8 and the conv launch's L2 prefetch of 5640376), in order:
#  1. tools/device/kdai4.sh: cuda_forward_k3_shapes under each intra form, the KDA chunked op tests, the forms' timings
#  2. tools/device/convpf.sh: the prefetch's op tests, Kimi-Linear-48B B = 1 A/B rounds
#  3. Kimi-Linear-48B prefill 8K under the default (fast) and the forms PF_AB names, PF_ROUNDS rounds alternating
#   P=<prebuilt dir> OUT=<dir> bash tools/device/s16_call1.sh   (kdai4.sh's and convpf.sh's knobs pass through)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
bash tools/device/kdai4.sh > /dev/null 2>&1
bash tools/device/convpf.sh > /dev/null 2>&1
SUMMARY=prefill.txt . tools/device/env.sh
pre() { grep -A3 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s (%s MFU)  ", $1, $2, $6}'; echo; }
for r in $(seq 1 "${PF_ROUNDS:-2}"); do
  for v in LUNAR_NONE=0 ${PF_AB:-LUNAR_KDA_INTRA=tc3 LUNAR_KDA_INTRA=tc}; do
    step "KL48 prefill 8K $v round $r"
    env $v timeout 90 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
      --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 4 > $OUT/pf_${v#*=}_$r.log 2>&1
    echo "rc=$? $(pre $OUT/pf_${v#*=}_$r.log)" >> $T
  done
done
step done
(cd "$OUT" && tar czf pf.tgz pf_*.log && rm -f pf_*.log)
cat $OUT/summary.txt $OUT/convpf.txt $T
