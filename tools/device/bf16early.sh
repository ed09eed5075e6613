#!/usr/bin/env bash
# Session 13, issue 9 (branch s13-klb1): the BF16 MoE decode pair with the shorter block start-up
# (LUNAR_MOE_BF16_EARLY, cuda_moe_bf16e.cu); docs/benchmarks.md "Decode B = 1: the BF16 pair's start-up
# (session 13, H200)". Call 1 ran it at deac98f (binaries of that commit: bit 1 = the down kernel's weights
# staged before the PDL wait, and LUNAR_SIDE_PRIO=1, both since out of the tree) with
# AB="LUNAR_MOE_BF16_EARLY=7 LUNAR_SIDE_PRIO=1 LUNAR_MOE_BF16_EARLY=7,LUNAR_SIDE_PRIO=1"; the tree's default AB
# is the variant left to time, =6 (bits 2 and 4).
# In order, each step only while time is left:
#  1. lunar_tests cuda_moe_bf16_early, cuda_moe_shared_row, cuda_moe_experts_bf16 (every EARLY value bit-equal
#     to the pair, within 1e-2 of the CPU op), then cuda_forward by default and under each variant of $AB
#     (graphs == eager, goldens); a failing op test drops the EARLY variants from the timing, a failing
#     cuda_forward its variant
#  2. Kimi-Linear-48B decode B = 1 (1K context, 64 steps), the default against each of $AB (space-separated;
#     a variant's assignments comma-separated), $ROUNDS rounds alternating
#  3. Nsight Compute on the op test's Kimi-Linear case (one token, 8 experts, D 2304, I 1024; each kernel
#     alone, no PDL overlap): 16 launches of the pair / EARLY kernels in the test's order, time and DRAM bytes
#   P=<prebuilt dir> OUT=<dir> [AB=...] [ROUNDS=4] [NCU=1] [BUDGET=110] tools/device/bf16early.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=bf16early.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
K=configs/kimi-linear-48b-a3b.json
AB=${AB:-LUNAR_MOE_BF16_EARLY=6}
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms (floor %s ms)  ", $1, $2, $3, $6}'; echo; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader >> $T 2>&1
for f in cuda_moe_bf16_early cuda_moe_shared_row cuda_moe_experts_bf16; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; rc=$?; echo "rc=$rc" >> $T
  [ $rc -ne 0 ] && AB=$(echo $AB | tr ' ' '\n' | grep -v BF16_EARLY | tr '\n' ' ')
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-220 | tail -6 >> $T
done
ok=""
for v in LUNAR_NONE=0 $AB; do
  left $(( ${BUDGET:-110} - 60 )) || break
  step "lunar_tests cuda_forward under $v"
  env ${v//,/ } OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward > $OUT/f_${v//[=,]/_}.log 2>&1; rc=$?
  echo "rc=$rc" >> $T; grep -E 'FAILED|passed, |CHECK' $OUT/f_${v//[=,]/_}.log | cut -c1-220 | tail -4 >> $T
  [ $rc -eq 0 ] && [ $v != LUNAR_NONE=0 ] && ok="$ok $v"
done
for r in $(seq 1 "${ROUNDS:-4}"); do
  i=0
  for v in LUNAR_NONE=0 $ok; do
    i=$((i + 1))
    left $(( ${BUDGET:-110} - 14 )) || break
    step "KL48 B=1 ctx 1K $v round $r"
    env ${v//,/ } timeout 25 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1 --contexts 1024 --steps 64 > $OUT/ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${i}_$r.log)" >> $T
  done
done
if [ "${NCU:-1}" = 1 ] && left $(( ${BUDGET:-110} - 12 )); then
  step "ncu: the pair and the EARLY kernels, Kimi-Linear's op-test case"
  timeout 30 ncu --clock-control none -k regex:'moe_decode_kernel|moe_bf16_early' --launch-count 16 --kill yes --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    --csv $P/bin/lunar_tests cuda_moe_bf16_early > $OUT/ncu.csv 2> $OUT/ncu.err
  echo "rc=$?" >> $T
  python3 - "$OUT/ncu.csv" >> $T 2>&1 <<'EOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ix = {k: h.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
out = {}
for r in rows[1:]:
    k = (int(r[ix["ID"]]), r[ix["Kernel Name"]].split("(")[0].replace("(anonymous namespace)::", "")[:48])
    out.setdefault(k, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for (i, name), m in sorted(out.items()):
    t = float(m.get("gpu__time_duration.sum", "0").replace(",", "")); b = float(m.get("dram__bytes_read.sum", "0").replace(",", ""))
    print(f"{i:3d} {name:48s} {t/1e3:8.2f} us {b/1e6:7.2f} MB {b/t/1e3 if t else 0:6.2f} TB/s grid {m.get('launch__grid_size')} regs {m.get('launch__registers_per_thread')} warps {m.get('sm__warps_active.avg.pct_of_peak_sustained_active')}")
EOF
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=bf16early.txt -- * && rm -rf t_* f_* ab_* ncu.err)
cat $T
