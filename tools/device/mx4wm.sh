#!/usr/bin/env bash
# Session 12, issue 8 (branch s12-mx4wm): MXFP4 MoE prefill with the weights as wgmma's M (path 25,
# cuda_moe_ws.cu moe_wm_kernel: LUNAR_MOE_PREFILL=wsmxm; path 26 = its gate/up + path 24's down:
# =wsmxg) in one device call: the MXFP4 experts op tests (every path vs the CPU op, 24-26 among
# them, bf16 rows bit for bit), the prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4: K3.1's
# full shape and its TP8 slice; paths 2, 22, then 24 / 25 / 26 with bf16 rows twice, 25 with fp32
# rows, 24 again, each with its gate/up and down kernel times), the K3.1 TP8 slice 8K prefill A/B
# (V: name:VAR=v,... in alternating order, ROUNDS rounds while AB_S seconds are not past), and the
# K3-shaped forward test under each FWD selection. Model: tools/device/mx4pre4.sh.
#   P=<prebuilt dir> OUT=<dir> [V="def:LUNAR_NONE=0 wm:LUNAR_MOE_PREFILL=wsmxm ..."] [ROUNDS=3] [AB_S=s] \
#     [FWD="wm:LUNAR_MOE_PREFILL=wsmxm"] [OPS=0] [BENCH=0] [ACTIVE="0 224 56"] tools/device/mx4wm.sh
# Call 1 (commit c4021d2): the defaults with ROUNDS=2 AB_S=100 FWD_S=125; call 2 (the large-expert
# tables, LUNAR_MOE_BENCH_ACTIVE): OPS=0 ACTIVE="224 56" ROUNDS=1 FWD="" with the rounds' order reversed.
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4wm.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
if [ "${OPS:-1}" = 1 ]; then
step "op tests: cuda_moe_experts_mxfp4 (paths 22, 24, 25, 26 among the others, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
for p in wsmxe wsmxb wsmxm wsmxg; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-200 | tail -8 >> $T
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
fi
if [ "${BENCH:-1}" = 1 ]; then
for act in ${ACTIVE:-0}; do  # LUNAR_MOE_BENCH_ACTIVE: only the first act experts routed (0: all)
step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4, LUNAR_MOE_BENCH_ACTIVE=$act)"
LUNAR_MOE_BENCH_ACTIVE=$act LUNAR_MOE_BENCH=prefill-mxfp4 timeout 70 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_$act.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured|BENCH_ACTIVE' $OUT/bench_$act.log | cut -c1-210 | sed 's/| router.*//' >> $T
done
fi
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF; exit}'; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { # name, env
  env $2 timeout 40 $S > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
V=${V:-"def:LUNAR_NONE=0 wm:LUNAR_MOE_PREFILL=wsmxm wg:LUNAR_MOE_PREFILL=wsmxg"}
for r in $(seq ${R0:-1} $(( ${R0:-1} + ${ROUNDS:-3} - 1 ))); do
  late ${AB_S:-95} && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  W=$V
  [ $((r % 2)) = 0 ] && W=$(echo $V | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $W; do e=${v#*:}; bench ${v%%:*}_$r "${e//,/ }"; done
done
FWD=${FWD-"wm:LUNAR_MOE_PREFILL=wsmxm"}
for v in $FWD; do
  late ${FWD_S:-140} && break
  n=${v%%:*}; e=${v#*:}
  step "cuda_forward_k3 under $n [$e] (the K3-shaped MXFP4 model vs the CPU)"
  env ${e//,/ } OMP_NUM_THREADS=16 timeout 30 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd_$n.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |k3, |CHECK' $OUT/t_fwd_$n.log | sed 's/, argmax.*//' | cut -c1-200 | tail -5 >> $T
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4wm.txt -- * && rm -f b_*.log t_fwd_*.log)  # 8 files come back
cat $T
