#!/usr/bin/env bash
# Session 13, issue 8 (branch s13-mx4sel): the MXFP4 MoE prefill with path 24 or 25 per item (path 28,
# LUNAR_MOE_PREFILL=wsmxhb, the default since: the gate/up's full 256-row tiles of each expert by path
# 24's kernel, its rest of <= 192 rows by path 25's; 24's down) in one device call: the MXFP4 experts
# op tests (every path vs the CPU op, 24-26 and 28 among them, bf16 rows bit for bit), the prefill
# kernel table (LUNAR_MOE_BENCH=prefill-mxfp4: K3.1's full shape and its TP8 slice, paths 24-26, 28 with
# bf16 rows in alternating order, each GEMM's own time; the random-operand peak of the same run), with
# all experts routed and with ACTIVE of 896, then the K3.1 TP8 slice's 8K prefill A/B (V, alternating
# order, ROUNDS rounds while AB_S seconds are not past; round 1's default run prints the per-expert row
# counts of its warm-up prefill: LUNAR_MOE_ROWSTATS), and a short table. Model: tools/device/mx4wm.sh.
#   P=<prebuilt dir> OUT=<dir> [V="def:LUNAR_NONE=0 wm:LUNAR_MOE_PREFILL=wsmxm ..."] [ROUNDS=3] [AB_S=s] \
#     [OPS=0] [BENCH=0] [ACTIVE="0 224"] [FWD="old:LUNAR_MOE_PREFILL=wsmxb"] tools/device/mx4sel.sh
# The call of docs/benchmarks.md "MoE prefill, MXFP4: path 24 or 25 per item" ran this script as of commit
# 9dbda0d (path 27, =wsmxh, the split in the down GEMM too, still in; the default path 24) with
# AB_S=110 FWD="mix:LUNAR_MOE_PREFILL=wsmxh" FWD_S=135 and
# V="def:LUNAR_NONE=0 wm:LUNAR_MOE_PREFILL=wsmxm mix:LUNAR_MOE_PREFILL=wsmxh mixb:LUNAR_MOE_PREFILL=wsmxhb".
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4sel.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
if [ "${OPS:-1}" = 1 ]; then
step "op tests: cuda_moe_experts_mxfp4 (paths 24-26, 28 among the others, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
for p in wsmxb wsmxm wsmxg wsmxhb; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -8 >> $T
if grep -qE 'rc=[1-9]' $T; then step "op tests failed or timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
fi
if [ "${BENCH:-1}" = 1 ]; then
for act in ${ACTIVE:-0 224}; do  # LUNAR_MOE_BENCH_ACTIVE: only the first act experts routed (0: all)
late ${BENCH_S:-100} && break
step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4, LUNAR_MOE_BENCH_ACTIVE=$act)"
LUNAR_MOE_BENCH_ACTIVE=$act LUNAR_MOE_BENCH=prefill-mxfp4 timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_$act.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured|BENCH_ACTIVE|peak' $OUT/bench_$act.log | cut -c1-210 | sed 's/| router.*//' >> $T
done
fi
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF; exit}'; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { # name, env
  env $2 timeout 40 $S > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
V=${V:-"def:LUNAR_NONE=0 old:LUNAR_MOE_PREFILL=wsmxb wm:LUNAR_MOE_PREFILL=wsmxm"}
for r in $(seq 1 ${ROUNDS:-3}); do
  late ${AB_S:-150} && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  W=$V
  [ $((r % 2)) = 0 ] && W=$(echo $V | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $W; do
    n=${v%%:*}; e=${v#*:}
    [ $r = 1 ] && [ $n = def ] && e="$e,LUNAR_MOE_ROWSTATS=10"
    bench ${n}_$r "${e//,/ }"
  done
done
grep -h 'moe rows' $OUT/b_def_1.log 2> /dev/null | sort | uniq -c | cut -c1-330 >> $T
FWD=${FWD-}
for v in $FWD; do
  late ${FWD_S:-170} && break
  n=${v%%:*}; e=${v#*:}
  step "cuda_forward_k3 under $n [$e] (the K3-shaped MXFP4 model vs the CPU)"
  env ${e//,/ } OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd_$n.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd_$n.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
done
step "table: 8K prefill of the TP8 slice, 10 layers (s), per round, and the mean"
for v in $V; do
  n=${v%%:*}
  grep -hE "^rc=0 ${n}_[0-9]+ " $T | sed -E 's/.*: 8192: ([0-9.]+) s.*/\1/' |
    awk -v n=$n '{s += $1; c++; l = l " " $1} END {if (c) printf "| %-5s |%s | mean %.4f |\n", n, l, s / c}' >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4sel.txt -- * && rm -f b_*.log t_fwd_*.log)  # 8 files come back
cat $T
