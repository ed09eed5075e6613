#!/usr/bin/env bash
# Session 17, issue 8, helper mx4f8 (branch s17-mx4f8), one call: path 16's widening with fewer ALU-pipe
# instructions, the same bits. LUNAR_MOE_F16_CV=1 (V_CV: the 4 prmt per word as cvt.rn.f16x2.e5m2x2, SASS
# F2FP.F16.E5M2.UNPACK_B) and =2 (V_CV | V_HI: also h's shift as IMAD.HI), with IL at one token. (The brief's
# FP8 mma.sync is emulated on sm_90a: F2FP unpacks + HMMA.16816, so it was not built; see docs/benchmarks.md.)
# Op tests (cuda_moe_experts_mxfp4: f16_il_case has CV=1/2 bit-equal to IL and the CPU op), cuda_forward_k3
# under CV=1; the pair at one token (f16ab, ROUNDS alternating) default / cv / cvh and the consumers alone
# (SKIP=3) under each; the K3.1 TP8 slice B = 1 TPOT, default / cv / cvh, rounds alternating.
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=4] [MROUNDS=3] [BUDGET=170] bash .xfer-mx4f8/s17_mx4f8.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
B=${BUDGET:-170}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader >> $T
step "op tests: cuda_moe_experts_mxfp4 (path 16 IL / CV=1 / CV=2 bit-equal, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
echo "rc=$?" >> $T
for cv in 0 1 2; do
  grep -E " f16 n=.* IL=[01] CV=$cv " $OUT/t_moe.log | grep -oE 'max rel err [0-9.e+-]+' | awk -v p="$cv" '{if ($4 + 0 > m) m = $4 + 0; n++}
    END {printf "path 16 CV=%s: %d runs vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK|differ|NaN' $OUT/t_moe.log | cut -c1-220 | tail -6 >> $T
S=LUNAR_MOE_F16_SKIP C=LUNAR_MOE_F16_CV
V="def:LUNAR_NONE=0 cv:$C=1 cvh:$C=2 cs:$S=3 cscv:$C=1,$S=3 cscvh:$C=2,$S=3"
step "decode pair at one token, path 16: $V (${ROUNDS:-4} rounds, alternating)"
LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-4} timeout 80 $P/bin/lunar_tests cuda_moe_bench \
  > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\||mean|one token|FAILED|CHECK' $OUT/bench.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
step "cuda_forward_k3 under CV=1"
LUNAR_MOE_F16_CV=1 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1; echo "rc=$? cuda_forward_k3 CV=1" >> $T
grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
M="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
for r in $(seq 1 "${MROUNDS:-3}"); do
  late $((B - 24)) && break
  W="def:LUNAR_NONE=0 cv:$C=1 cvh:$C=2"; [ $((r % 2)) = 0 ] && W="cvh:$C=2 cv:$C=1 def:LUNAR_NONE=0"
  for v in $W; do
    step "K3.1 TP8 slice B=1 ${v%%:*} round $r"
    env $(echo "${v#*:}" | tr ',' ' ') timeout 30 $M > $OUT/m_${v%%:*}_$r.log 2>&1
    echo "rc=$? ${v%%:*}_$r $(tpot $OUT/m_${v%%:*}_$r.log)" >> $T
  done
done
step "summary: pair at one token (us, means over rounds; f16ab) and TPOT ms (K3.1 TP8 slice B=1)"
grep -E ' mean ' $OUT/bench.log | sed -E 's/LUNAR_MOE_F16_//g' >> $T
for n in def cv cvh; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*B1\/[0-9]+ ([0-9.]+) ms.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.3f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f m_*.log t_*.log)
cat $T
