#!/usr/bin/env bash
# Session 10, issue 8 round 3 (branch s10-mx4pre): MXFP4 MoE prefill, path 22 (cuda_moe_ws.cu
# moe_wy_kernel<., true>: path 14 with the down epilogue's row weights loaded once per item and the
# next item looked up before the drain; the MXFP4 default since) against path 14
# (LUNAR_MOE_PREFILL=wsmx2), in one device call: the MXFP4 experts op tests (every path vs the CPU op,
# 14 and 22 among them), the prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4: K3.1's full shape
# and its TP8 slice; paths 2, 4, then 14, 22, 22, 14, each with its gate/up and down kernel times),
# the K3.1 TP8 slice 8K prefill A/B (default against MODES and AB_EXTRA, alternating order), the
# forward tests under FWD_MODE (default: the defaults), and (time left) Nsight Compute: NCU=down the
# TP8 slice's down kernel (path 14's 9 launches, then path 22's first), NCU=1 the first K3.1 gate/up
# launch of each.
# History: the session's two calls ran this script's first forms (commits 6306aeb and 9ac592b), with
# path 14's variants 19 (=wsmxd: 4 B buffers, wgmma_wait<2>), 20 (=wsmxp: the producer warpgroup
# widening words 2-3 of every block), 21 (=wsmxdp: both) and 23 (=wsmxes: 22 copying no A rows past
# an expert's end), all measured slower and removed after call 2; call 1 A/B'd the table's fastest
# variant (19) against the default, call 2 ran MODES="wsmxe wsmxes"
# AB_EXTRA="ybf:LUNAR_MOE_PREFILL=wsmxe,LUNAR_MOE_YBUF=bf16" FWD_MODE=wsmxes NCU=down.
#   P=<prebuilt dir> OUT=<dir> [MODES=wsmx2] [AB_EXTRA="name:VAR=v,VAR2=w ..."] [ROUNDS=3] [AB_S=s] \
#     [FWD_MODE=mode] [NCU=down|1|0] tools/device/mx4pre3.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4pre3.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (paths 14 and 22 among the others, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsmx(2|e) |FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-150 > $OUT/t_moe_sel.txt
# the worst error of each path over every case
for p in wsmx2 wsmxe; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-160 | tail -8 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4)"
LUNAR_MOE_BENCH=prefill-mxfp4 timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-200 | sed 's/| router.*//' >> $T
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF; exit}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(experts|moe)$/ {printf "%s %s; ", $1, $2}' "$1"; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { # name, env
  env $2 timeout 40 $S ${PROF:-} > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
MODES=${MODES-wsmx2}
for r in $(seq 1 ${ROUNDS:-3}); do
  late ${AB_S:-110} && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  V="def:LUNAR_NONE=0"
  for m in $MODES; do V="$V $m:LUNAR_MOE_PREFILL=$m"; done
  V="$V ${AB_EXTRA:-}"
  [ $((r % 2)) = 0 ] && V=$(echo $V | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $V; do e=${v#*:}; bench ${v%%:*}_$r "${e//,/ }"; done
done
FM=${FWD_MODE:-default}
! late ${FWD_S:-150} && { step "LUNAR_MOE_PREFILL=$FM: cuda_moe_layer, cuda_forward (the MXFP4 goldens on its path)"
  LUNAR_MOE_PREFILL=$FM OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_layer > $OUT/t_layer.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_layer.log | cut -c1-160 | tail -3 >> $T
  LUNAR_MOE_PREFILL=$FM OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -12 >> $T; }
ncu_sum() { python3 - "$1" <<'PY'
import re, sys
blocks = re.split(r'\n(?=\s*void moe_wy_kernel)', open(sys.argv[1]).read())
keep = [b for b in blocks if 'void moe_wy_kernel' in b]
for b in [keep[0], keep[-1]] if len(keep) > 1 else keep:
    print(b.strip().split('\n')[0][:60])
    for l in b.split('\n'):
        if re.search(r'Duration|Throughput|Warp Cycles Per Issued|inst_executed|issue_stalled', l):
            f = l.split()
            if 'issue_stalled' in l and float(f[-1].replace(',', '')) < 0.1: continue
            print('  ', ' '.join(f).replace('smsp__average_warps_issue_stalled_', '')[:90])
PY
}
NM="--section SpeedOfLight --section WarpStateStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum"
# the table's K3.1 rows launch moe_wy_kernel<down, 14 or 22> 36 times before the TP8 rows' path 14 (9) and 22
if [ "${NCU:-down}" = down ] && command -v ncu > /dev/null && ! late ${NCU_S:-165}; then
  step "ncu moe_wy_kernel<down>: TP8 slice, path 14's 9 launches, then path 22's first"
  LUNAR_MOE_BENCH=prefill-mxfp4 timeout 45 ncu --clock-control none --kernel-name-base mangled \
    -k regex:'moe_wy_kernelILb0E' --launch-skip 36 -c 10 $NM $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_wy.txt 2>&1
  echo "rc=$?" >> $T; ncu_sum $OUT/ncu_wy.txt >> $T
fi
if [ "${NCU:-down}" = 1 ] && command -v ncu > /dev/null; then
  for e in 0 1; do  # EPI = 0: path 14, 1: path 22
    late ${NCU_S:-165} && break
    step "ncu moe_wy_kernel<gate/up, EPI = $e>: first launch, K3.1 full shape"
    LUNAR_MOE_BENCH=prefill-mxfp4 timeout 45 ncu --clock-control none --kernel-name-base mangled \
      -k regex:"moe_wy_kernelILb1ELb${e}E" -c 1 $NM $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_gu$e.txt 2>&1
    echo "rc=$?" >> $T; ncu_sum $OUT/ncu_gu$e.txt >> $T
  done
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4pre3.txt -- * && rm -f b_*.log t_fwd.log t_layer.log ncu_*.txt)  # 8 files come back
cat $T
