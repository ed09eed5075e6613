#!/usr/bin/env bash
# Session 14, issue 8 (branch s14-mx4d), second call: path 32 (HALF only: the down kernel copies no A rows
# of dead 64-row halves) as the MXFP4 default: the MXFP4 experts op tests, the prefill kernel table
# (24, 28, 32 alternating; ACTIVE=224: the first call ran ACTIVE=0 with LUNAR_MOE_MXD=1, this code), the TP8 slice's 8K prefill A/B (def = 32 vs LUNAR_MOE_PREFILL=wsmxhb
# = 28, alternating), cuda_forward_k3 under the default if time is left. First call: tools/device/mx4d.sh.
#   P=<prebuilt dir> OUT=<dir> bash mx4d2.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
step "op tests: cuda_moe_experts_mxfp4 (path 32 = wsmxdh, the default)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
for p in wsmxb wsmxhb wsmxdh; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK|differ' $OUT/t_moe.log | cut -c1-200 | tail -8 >> $T
if grep -qE 'rc=[1-9]' $T; then step "op tests failed or timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; (cd $OUT && tar czf logs.tgz t_moe.log); cat $T; exit 1; fi
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF; exit}'; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { env $2 timeout 30 $S > $OUT/b_$1.log 2>&1; echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T; }
for r in 1 2 3 4; do
  late ${AB_S:-62} && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  W="def:LUNAR_NONE=0 s13:LUNAR_MOE_PREFILL=wsmxhb"; [ $((r % 2)) = 0 ] && W="s13:LUNAR_MOE_PREFILL=wsmxhb def:LUNAR_NONE=0"
  for v in $W; do bench ${v%%:*}_$r "${v#*:}"; done
done
if ! late ${BENCH_S:-70}; then
  step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4, ACTIVE=224)"
  LUNAR_MOE_BENCH_ACTIVE=224 LUNAR_MOE_BENCH=prefill-mxfp4 timeout 20 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-200 | sed 's/| router.*//' >> $T
fi
step "table: 8K prefill of the TP8 slice, 10 layers (s)"
for n in def s13; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*: 8192: ([0-9.]+) s.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.4f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f b_*.log bench*.log t_*.log)
cat $T
