#!/usr/bin/env bash
# Session 14, issue 9 (branch s14-bgr): BF16 experts on Kimi-Linear-48B's 8K prefill, path 29 (the default,
# running as itself since 42ca40b) against path 6 (LUNAR_MOE_PREFILL=ws, what the default ran before the fix),
# in one call, every step under a timeout and no step started after END_S seconds. The short-tile variant that
# docs/benchmarks.md "BF16 grouped GEMMs: the short tiles with the weights as M" measured with this script was
# taken out of the tree after that measurement: its version of the script is `git show 42ca40b:tools/device/bgr.sh`.
#  1. the op tests: cuda_moe_experts_bf16 (path 29 on every BF16 wgmma case and on experts of 1, 31, 129, 255,
#     300 rows), cuda_moe_layer and cuda_forward with wsdyn (path 29 through the layer and the forward)
#  2. LUNAR_MOE_BENCH=prefill-bf16 cuda_moe_bench (both GEMMs, 8192 tokens: 12, 29 with fp32 and bf16 rows)
#  3. the model's routing: LUNAR_MOE_ROWSTATS on one 8K prefill (rows issued per live row, path 29)
#  4. [NCU=1] Nsight Compute of the expert kernels in one 8K prefill, default (29) then ws (6)
#  5. ROUNDS alternating rounds of the 8K prefill, default (29) vs ws (no round started after AB_S seconds)
#   P=<prebuilt dir> OUT=<dir> [ROUNDS=5] [AB_S=170] [END_S=200] [NCU=1] [TESTS=1] [ROWS=1] [V="env ..."] [NCUV="env ..."] [NCU_S=120] tools/device/bgr.sh
# (call 2: TESTS=2 runs cuda_moe_experts_bf16 alone; V: the variants of each round, rotated one place a round)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
left() { [ $(( $(date +%s) - t0 )) -lt "${1:-${END_S:-200}}" ]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
tst() {  # name [env]
  left || return
  step "lunar_tests $1 ${2:-}"
  env ${2:-LUNAR_NONE=0} LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $1 > $OUT/t_$1${2:+_env}.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, ' $OUT/t_$1${2:+_env}.log | cut -c1-200 | tail -4 >> $T
}
tst cuda_moe_experts_bf16
for p in wsdyn; do
  grep -E " $p " $OUT/t_cuda_moe_experts_bf16.log | awk -v p=$p '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9.]+e[-+][0-9]+$/) {v = $i + 0; if (/ vs /) {if (v > mv) mv = v} else if (v > mc) mc = v}} END {printf "%s: %d lines, max rel err vs CPU %.3g, vs the case'"'"'s first path %.3g\n", p, NR, mc, mv}' >> $T
done
grep -E ' wsdyn ' $OUT/t_cuda_moe_experts_bf16.log | grep -E 'n=(1|31|129|255|300) k=(2|3) E=8' | cut -c1-160 >> $T
if [ "${TESTS:-1}" = 1 ]; then
  tst cuda_moe_layer LUNAR_MOE_PREFILL=wsdyn
  tst cuda_forward LUNAR_MOE_PREFILL=wsdyn
fi
if left; then
  step "cuda_moe_bench prefill-bf16"
  LUNAR_MOE_BENCH=prefill-bf16 timeout 45 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\| prefill|Measured here' $OUT/bench.log | grep -vE 'mma.sync' | cut -c1-200 >> $T
fi
if [ "${ROWS:-1}" = 1 ] && left; then
  step "rowstats (default, one 8K prefill)"
  LUNAR_MOE_ROWSTATS=4 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/rows.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'moe rows' $OUT/rows.log | tail -2 | cut -c1-260 >> $T
fi
if [ "${NCU:-1}" = 1 ]; then
  for v in ${NCUV:-LUNAR_NONE=0 LUNAR_MOE_PREFILL=ws}; do
    left "${NCU_S:-120}" || break
    step "ncu expert kernels [$v]"
    env $v timeout 45 ncu --replay-mode application --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv -k regex:'moe_ws_kernel' \
      --launch-count 104 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu_$v.csv 2> $OUT/ncu_$v.err
    echo "ncu rc=$?" >> $T
    python3 - $OUT/ncu_$v.csv >> $T <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    k.setdefault(int(r[ii]), {"name": r[ki].split("(")[0].replace("void ", "")})[r[mi]] = float(r[vi].replace(",", ""))
by = collections.defaultdict(list)
for d in k.values(): by[d["name"]].append(d)
for n, ds in by.items():  # the 8K prefill's launches: the larger half (the bench's first forward is shorter)
    ds = sorted(ds, key=lambda d: -d.get("gpu__time_duration.sum", 0))[:max(1, len(ds) // 2)]
    t = sum(d.get("gpu__time_duration.sum", 0) for d in ds) / len(ds) / 1e3
    rd = sum(d.get("dram__bytes_read.sum", 0) for d in ds) / len(ds) / 1e6
    print("%-44s %3d launches (top %d): %.1f us, read %.1f MB" % (n[:44], len(by[n]), len(ds), t, rd))
PY
  done
fi
set -- ${V:-LUNAR_NONE=0 LUNAR_MOE_PREFILL=ws}
for r in $(seq 1 "${ROUNDS:-5}"); do
  left "${AB_S:-170}" || break
  i=0
  for v in "$@"; do
    i=$((i + 1))
    env $v timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/pf_${i}_$r.log 2>&1
    echo "rc=$? round $r [$v]: $(awk '/^prefill/ {f = 1; next} /^$/ {f = 0} f && $1 ~ /^[0-9]+$/ {print $1, $2 " s", $6, $7}' $OUT/pf_${i}_$r.log | tr '\n' ' ')" >> $T
  done
  set -- "$@" "$1"; shift  # the next round starts with the next variant
done
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && rm -rf t_* pf_* ncu_* rows.log bench.log)
cat $T
