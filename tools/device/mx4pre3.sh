#!/usr/bin/env bash
# Session 10, issue 8 round 3 (branch s10-mx4pre): MXFP4 MoE prefill, path 14 (cuda_moe_ws.cu
# moe_wy_kernel) and its variants 19 (LUNAR_MOE_PREFILL=wsmxd: 4 B buffers, wgmma_wait<2>), 20
# (=wsmxp: the producer warpgroup widens words 2-3 of every block) and 21 (=wsmxdp: both), in one
# device call: the MXFP4 experts op tests (every path vs the CPU op, 19-21 among them), the prefill
# kernel table (LUNAR_MOE_BENCH=prefill-mxfp4: K3.1's full shape and its TP8 slice; paths 14, 19,
# 20, 21, then 21, 20, 19, 14 again, each with its gate/up and down kernel times), the K3.1 TP8
# slice 8K prefill A/B (default = path 14 against MODES, unset: the variant fastest on the table's
# TP8 rows; alternating order), the forward tests under the first of MODES (FWD_MODE), and (time
# left) Nsight Compute on path 14's and that variant's first K3.1 gate/up launch (speed of light,
# warp stalls).
# Call 2 (path 22, =wsmxe: the down epilogue's row weights loaded once, the next item looked up
# under the drain; 23, =wsmxes: 22 without copies of the A rows past an expert's end): MODES="wsmxe
# wsmxes" AB_EXTRA="ybf:LUNAR_MOE_PREFILL=wsmxe,LUNAR_MOE_YBUF=bf16" FWD_MODE=wsmxes NCU=down.
#   P=<prebuilt dir> OUT=<dir> [MODES="wsmxp wsmxdp wsmxd"] [ROUNDS=3] [AB_S=s] [FWD_MODE=wsmxp] [NCU=1|down] \
#     [AB_EXTRA="name:VAR=v,VAR2=w ..."] \
#     tools/device/mx4pre3.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
SUMMARY=mx4pre3.txt . tools/device/env.sh
late() { [ $(( $(date +%s) - t0 )) -gt $1 ]; }
nvidia-smi -L >> $T
step "op tests: cuda_moe_experts_mxfp4 (paths 14, 19-21 among the others, vs the CPU op)"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1; echo "rc=$?" >> $T
grep -E ' wsmx(2|d|p|dp|e|es) |FAILED|passed, |CHECK' $OUT/t_moe.log | awk '{print}' | cut -c1-150 > $OUT/t_moe_sel.txt
# the worst error of each path over every case
for p in wsmx2 wsmxd wsmxp wsmxdp wsmxe wsmxes; do
  grep -E "experts mxfp4 [a-z]+ $p n=" $OUT/t_moe.log | grep -oE 'err[ =:]*[0-9.e+-]+' | awk -v p=$p '{sub(/err[ =:]*/, ""); if ($1 + 0 > m) m = $1 + 0; n++} END {printf "%s: %d cases vs the CPU op, max rel err %.3g\n", p, n, m}' >> $T
done
grep -E 'FAILED|passed, |CHECK' $OUT/t_moe.log | cut -c1-160 | tail -8 >> $T
# a hung kernel (a barrier protocol error) would hang every later step too
if grep -q 'rc=124' $T; then step "op tests timed out: stopping"; tail -5 $OUT/t_moe.log >> $T; cat $T; exit 1; fi
step "prefill kernel table (LUNAR_MOE_BENCH=prefill-mxfp4)"
LUNAR_MOE_BENCH=prefill-mxfp4 timeout 60 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
grep -E '^\| prefill|Measured' $OUT/bench.log | cut -c1-200 | sed 's/| router.*//' >> $T
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(experts|moe)$/ {printf "%s %s; ", $1, $2}' "$1"; }
S="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 1"
bench() { # name, env
  env $2 timeout 40 $S ${PROF:-} > $OUT/b_$1.log 2>&1
  echo "rc=$? $1 [$2]: $(pre $OUT/b_$1.log)" >> $T
}
# MODES unset: the variant whose rounds in the table's TP8 rows (the model's shape) average lowest
if [ -z "${MODES:-}" ]; then
  best=$(awk -F'|' '/^\| prefill K3.1 TP8/ && $3 ~ /\((19|20|21)\)/ {match($3, /\((19|20|21)\)/); p = substr($3, RSTART + 1, 2); t[p] += $5; n[p]++}
    END {b = ""; for (p in t) if (b == "" || t[p] / n[p] < t[b] / n[b]) b = p; print b}' $OUT/bench.log)
  case "$best" in 19) MODES=wsmxd ;; 20) MODES=wsmxp ;; 21) MODES=wsmxdp ;; *) MODES="wsmxp" ;; esac
  echo "A/B variant (lowest TP8 mean in the table): path $best = $MODES" >> $T
fi
for r in $(seq 1 ${ROUNDS:-3}); do
  late ${AB_S:-110} && break
  step "K3.1 TP8 slice 8K prefill A/B round $r"
  V="def:LUNAR_NONE=0"
  for m in $MODES; do V="$V $m:LUNAR_MOE_PREFILL=$m"; done
  V="$V ${AB_EXTRA:-}"
  [ $((r % 2)) = 0 ] && V=$(echo $V | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $V; do e=${v#*:}; bench ${v%%:*}_$r "${e//,/ }"; done
done
FM=${FWD_MODE:-${MODES%% *}}
! late ${FWD_S:-150} && { step "LUNAR_MOE_PREFILL=$FM: cuda_moe_layer, cuda_forward (the MXFP4 goldens on its path)"
  LUNAR_MOE_PREFILL=$FM OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_moe_layer > $OUT/t_layer.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_layer.log | cut -c1-160 | tail -3 >> $T
  LUNAR_MOE_PREFILL=$FM OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|median|CHECK' $OUT/t_fwd.log | cut -c1-160 | tail -12 >> $T; }
NV=$(case "${MODES%% *}" in wsmxd) echo 1 ;; wsmxdp) echo 3 ;; wsmxe) echo 4 ;; *) echo 2 ;; esac)
# NCU=down: the TP8 slice's down kernel instead, path 14's 9 launches then the variant's first (the
# table runs 14, 22, 19, 20, 21, 22, 14 on K3.1's full shape first: 36 launches of V = 0 or 4 to skip)
if [ "${NCU:-1}" = down ] && command -v ncu > /dev/null && ! late ${NCU_S:-165}; then
  step "ncu moe_wy_kernel<down, V = 0 (path 14), $NV>: TP8 slice, 9 launches of 14 then the variant's first"
  LUNAR_MOE_BENCH=prefill-mxfp4 timeout 45 ncu --clock-control none --kernel-name-base mangled \
    -k regex:"moe_wy_kernelILb0ELi[0$NV]E" --launch-skip 36 -c 10 --section SpeedOfLight --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_wy.txt 2>&1
  echo "rc=$?" >> $T
  python3 - $OUT/ncu_wy.txt >> $T <<'PY'
import re, sys
blocks = re.split(r'\n(?=\s*void moe_wy_kernel)', open(sys.argv[1]).read())
keep = [b for b in blocks if 'void moe_wy_kernel' in b]
for b in [keep[0], keep[-1]] if keep else []:
    print(b.strip().split('\n')[0][:60])
    for l in b.split('\n'):
        if re.search(r'Duration|Throughput|Warp Cycles Per Issued|inst_executed|issue_stalled', l):
            f = l.split()
            if 'issue_stalled' in l and float(f[-1].replace(',', '')) < 0.1: continue
            print('  ', ' '.join(f).replace('smsp__average_warps_issue_stalled_', '')[:90])
PY
fi
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null && ! late ${NCU_S:-165}; then
  step "ncu moe_wy_kernel<gate/up, V = 0 (path 14), $NV>: first launch each, K3.1 full shape"
  LUNAR_MOE_BENCH=prefill-mxfp4 timeout 45 ncu --clock-control none --kernel-name-base mangled \
    -k regex:"moe_wy_kernelILb1ELi[0$NV]E" -c 2 --section SpeedOfLight --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/ncu_wy.txt 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe_wy_kernel|Duration|Throughput|Warp Cycles|Issued|inst_executed' $OUT/ncu_wy.txt | tr -s ' ' | cut -c1-120 | head -30 >> $T
  grep -E 'moe_wy_kernel|issue_stalled' $OUT/ncu_wy.txt | awk '/moe_wy/ || $NF + 0 >= 0.1' | sed 's/smsp__average_warps_issue_stalled_//' | tr -s ' ' | cut -c1-90 >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4pre3.txt -- * && rm -f b_*.log t_fwd.log t_layer.log ncu_*.txt)  # 8 files come back
cat $T
