#!/usr/bin/env bash
# Session 8, issue 9 (branch s8-kdaconv): the KDA prefill's conv pass (kda_conv_qkv_prefill2_kernel) and
# the f_b GEMM with the gate in its epilogue (kda_gate_gemm_kernel). The op and model tests, then the
# Kimi-Linear 8K / 32K prefill, new (default) against LUNAR_KDA_CONV=old,LUNAR_KDA_GATE=old in
# alternating rounds, then ncu passes over the KDA prefill kernels (time, DRAM bytes, occupancy).
# (Session 8's second call also ran LUNAR_KDA_CONV=w32, the 32-token warp runs, now the default.)
#   P=<prebuilt dir> OUT=<dir> [LONG=1: 32K in round 1] [AB_S=s: no further round after s seconds]
#   [NCU_S=s: no ncu pass started after s seconds] [NCU_OLD=1: the old kernels' pass too] tools/device/kdaconv.sh
set -u
P=${P:-.xfer-kdaconv}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
step "lunar_tests cuda_kda"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_kda > $OUT/t_kda.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK|gate_gemm|conv_qkv_prefill [qkv] T=300' $OUT/t_kda.log | cut -c1-160 | tail -22 >> $T
step "lunar_tests cuda_forward"
OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -6 >> $T
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && $1 ~ /^(kda_proj|kda_core|kda_out|experts)$/ {printf "%s %s; ", $1, $2}' "$1"; }
bench() { # name, env (comma-separated), lunar bench arguments
  local n=$1 e=$2; shift 2
  env ${e//,/ } timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda "$@" > $OUT/b_$n.log 2>&1
  echo "rc=$? $n [$e]: $(pre $OUT/b_$n.log)" >> $T
}
OLD=LUNAR_KDA_CONV=old,LUNAR_KDA_GATE=old
for r in 1 2 3; do
  step "A/B round $r"
  if [ $r = 1 ] && [ -n "${LONG:-}" ]; then L="--max-len 36864 --input-lens 8192,32768"; else L="--max-len 9000 --input-lens 8192"; fi
  bench new_$r LUNAR_NONE=0 $L --batch-sizes 1 --contexts 1024 --steps 1 --profile
  bench old_$r $OLD $L --batch-sizes 1 --contexts 1024 --steps 1 --profile
  [ $(( $(date +%s) - t0 )) -gt ${AB_S:-60} ] && break
done
ncu_pass() { # name, env
  local n=$1 e=$2
  env ${e//,/ } timeout 38 ncu --replay-mode application --clock-control none --print-units base --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    -k regex:'kda_conv|kda_gate|short_conv_state' $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 9000 \
    --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/ncu_$n.csv 2> $OUT/ncu_$n.err
  echo "ncu $n rc=$?" >> $T
  python3 - $OUT/ncu_$n.csv >> $T <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ii = h.index("ID"); mi = h.index("Metric Name")
k = collections.OrderedDict()
for r in rows[1:]:
    k.setdefault(int(r[ii]), {"name": r[ki].split("(")[0].replace("void ", "")})[r[mi]] = float(r[vi].replace(",", ""))
by = collections.defaultdict(list)
for d in k.values(): by[d["name"]].append(d)
for n, ds in by.items():
    ds = sorted(ds, key=lambda d: -d.get("gpu__time_duration.sum", 0))[:20]  # the 8K prefill's 20 KDA layers
    t = sum(d.get("gpu__time_duration.sum", 0) for d in ds) / len(ds) / 1e3
    rd = sum(d.get("dram__bytes_read.sum", 0) for d in ds) / len(ds) / 1e6
    wr = sum(d.get("dram__bytes_write.sum", 0) for d in ds) / len(ds) / 1e6
    oc = sum(d.get("sm__warps_active.avg.pct_of_peak_sustained_active", 0) for d in ds) / len(ds)
    print("%-48s top%d: %.1f us, read %.1f MB, write %.1f MB, %.2f TB/s, occupancy %.1f %%" % (n[:48], len(ds), t, rd, wr, (rd + wr) / t if t else 0, oc))
PY
}
[ $(( $(date +%s) - t0 )) -lt ${NCU_S:-105} ] && { step "ncu new"; ncu_pass new LUNAR_NONE=0; }
if [ -n "${NCU_OLD:-}" ]; then step "ncu old"; ncu_pass old $OLD; fi
step done
(cd "$OUT" && gzip -f ncu_*.csv; tar czf all.tgz --exclude=all.tgz --exclude=summary.txt -- * && rm -rf t_* b_* ncu_*)
cat $T
