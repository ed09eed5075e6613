#!/usr/bin/env bash
# Session 16, issue 8, helper mx4b (branch s16-mx4b): path 16's copy ring at one token without the scale
# copies (LUNAR_MOE_F16_SS, V_SS) and with the down kernel's 8-stage ring (LUNAR_MOE_F16_D8, V_D8). The MoE op
# test (f16_il_case: IL vs the CPU op, SS and SS + D8 bit-equal to IL at TILES 0 / 3 / 1, XS unset / 2); the
# pair at one token (LUNAR_MOE_BENCH=f16ab, rounds alternating, K3.1 and its TP8 slice) under IL (the
# default), SS, SS + D8, and the copy ring alone (SKIP=2) under each; the K3.1 TP8 slice's B = 1 step,
# default vs SS vs SS + D8, rounds alternating, as the budget allows.
# Ran once (session 16, binaries of 3fa5525: ROUNDS=4 MROUNDS=2 BUDGET=108; docs/benchmarks.md "MoE decode, MXFP4,
# at one token: the scales out of the ring (session 16)"). D8 is out of the tree since (measured slower; git show
# 3fa5525), and SS's wait moved behind the activation loads: the defaults below are now IL vs SS (and the rings
# alone); V="name:VAR=val,... ..." and TP="name:VAR=val ..." override the bench's and the step's variants.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=4] [MROUNDS=3] [BUDGET=115] [V=...] [TP=...] bash tools/device/mx4v16c.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
B=${BUDGET:-115}
nvidia-smi -L >> $T
step "op test: cuda_moe_experts_mxfp4 (IL vs the CPU op; SS, SS + D8 bit-equal to IL)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
grep -E " f16 n=.* IL=1 TILES" $OUT/t_moe.log | grep -oE 'max rel err [0-9.e+-]+' | awk '{if ($4 + 0 > m) m = $4 + 0; n++}
  END {printf "path 16 IL: %d runs vs the CPU op, max rel err %.3g\n", n, m}' >> $T
echo "SS=1 bit-equal to IL: $(grep -c 'SS=1: bit-equal' $OUT/t_moe.log) runs" >> $T
grep -E 'FAILED|passed, |CHECK|differ|NaN' $OUT/t_moe.log | cut -c1-220 | tail -6 >> $T
S=LUNAR_MOE_F16_SKIP SS=LUNAR_MOE_F16_SS=1
V=${V:-"il:LUNAR_NONE=0 ss:$SS coil:$S=2 coss:$S=2,$SS"}
step "decode pair at one token, path 16: $V (${ROUNDS:-4} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-4} timeout 60 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
TP=${TP:-"def:LUNAR_NONE=0 ss:$SS"}
for r in $(seq 1 "${MROUNDS:-3}"); do
  W=$TP; [ $((r % 2)) = 0 ] && W=$(echo $TP | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $W; do
    late $((B - 12)) && break 2
    step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
    env $(echo "${v#*:}" | tr ',' ' ') timeout 25 $M > $OUT/m_${v%%:*}_$r.log 2>&1
    echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
  done
done
step "table: TPOT ms, K3.1 TP8 slice B=1"
for n in $(for v in $TP; do echo ${v%%:*}; done); do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log)
cat $T
