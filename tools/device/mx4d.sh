#!/usr/bin/env bash
# Session 14, issue 8 (branch s14-mx4d): path 32 (LUNAR_MOE_PREFILL=wsmxd: path 28's gate/up, path 24's
# down kernel with the bits MXD_HALF / MXD_PRE / MXD_RWE, cuda_moe_ws.cu) in one device call: the MXFP4
# experts op tests (path 32 with all bits among every path), the prefill kernel table (24, 28, 32
# alternating, each GEMM's time) with LUNAR_MOE_MXD=7, 1, 6 and ACTIVE=224, the TP8 slice's 8K prefill
# A/B (28 vs 32, alternating), cuda_forward_k3 under wsmxd.
#   P=<prebuilt dir> OUT=<dir> bash mx4d.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (path 32 = wsmxd, LUNAR_MOE_MXD=7)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 80 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
for p in wsmxb wsmxhb wsmxd; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK|differ' $OUT/t_moe.log | cut -c1-200 | tail -8 >> $T
if grep -qE 'rc=[1-9]' $T; then step "op tests failed or timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; (cd $OUT && tar czf logs.tgz t_moe.log); cat $T; exit 1; fi
for v in 7:0 1:0 6:0 7:224; do
  late 100 && break
  m=${v%%:*}; act=${v#*:}
  step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4, LUNAR_MOE_MXD=$m, ACTIVE=$act)"
  LUNAR_MOE_MXD=$m LUNAR_MOE_BENCH_ACTIVE=$act LUNAR_MOE_BENCH=prefill-mxfp4 timeout 45 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${m}_$act.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| prefill|Measured' $OUT/bench_${m}_$act.log | cut -c1-200 | sed 's/| router.*//' >> $T
done
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF; exit}'; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { env $2 timeout 35 $S > $OUT/b_$1.log 2>&1; echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T; }
V="def:LUNAR_NONE=0 mxd:LUNAR_MOE_PREFILL=wsmxd"
for r in 1 2 3; do
  late 135 && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  W=$V; [ $((r % 2)) = 0 ] && W="mxd:LUNAR_MOE_PREFILL=wsmxd def:LUNAR_NONE=0"
  for v in $W; do bench ${v%%:*}_$r "${v#*:}"; done
done
if ! late 160; then
step "cuda_forward_k3 under wsmxd"
LUNAR_MOE_PREFILL=wsmxd OMP_NUM_THREADS=16 timeout 25 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
fi
step "table: 8K prefill of the TP8 slice, 10 layers (s)"
for n in def mxd; do
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*: 8192: ([0-9.]+) s.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.4f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -f b_*.log bench_*.log t_*.log)
cat $T
