#!/usr/bin/env bash
# Session 12, issue 9 (branch s12-klpre): the Kimi-Linear-48B 8K prefill, kernel by kernel and A/B.
#   P=<prebuilt dir: bin/lunar, bin/lunar_tests, lib/> OUT=<dir> [TESTS="names"] [NCU=1] [EV=1]
#   [AB="envA envB ..." (comma-separated variables inside one variant; LUNAR_NONE=0 = the defaults)]
#   [ROUNDS=n] [AB_S=s: no round started after s seconds] [NCU_K=regex [NCU_ENV=a,b]] tools/device/klpre.sh
# TESTS: lunar_tests per name (verbose log under OUT). NCU: Nsight Compute on one 8K prefill (application
# replay; the regex skips the dummy-weight generators), table by ncu_step.py max (the prefill forward) with
# DRAM read + write. EV: LUNAR_STEP_EVENTS=2 (the device-event split of the prefill, per layer).
# AB: the 8K prefill (time_s, MFU and the profile of one prefill) per variant, variants alternating.
# NCU_K: Nsight Compute on the kernels the regex names (under NCU_ENV), the mean of each one's 8K launches.
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
for t in ${TESTS:-}; do
  step "lunar_tests $t"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $t > $OUT/t_$t.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$t.log | cut -c1-200 | tail -8 >> $T
done
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && NF >= 2 && $2 ~ /^[0-9.]+$/ && $1 ~ /^[a-z_]+$/ {printf "%s %s; ", $1, $2}' "$1"; }
if [ -n "${AB:-}" ]; then
  for r in $(seq 1 "${ROUNDS:-3}"); do
    step "A/B round $r"
    i=0
    for e in $AB; do
      i=$((i + 1))
      env ${e//,/ } timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF --profile > $OUT/b_${i}_$r.log 2>&1
      echo "rc=$? v$i [$e]: $(pre $OUT/b_${i}_$r.log)" >> $T
    done
    [ $(( $(date +%s) - t0 )) -gt ${AB_S:-100} ] && break
  done
fi
if [ -n "${EV:-}" ]; then
  step "step events"
  LUNAR_STEP_EVENTS=2 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ev.log 2>&1
  echo "rc=$?" >> $T; grep 'lunar step events: T=' $OUT/ev.log | tail -1 | cut -c1-420 >> $T
fi
if [ -n "${NCU:-}" ]; then
  step "ncu: one 8K prefill, per kernel"
  timeout ${NCU_T:-100} ncu --replay-mode application --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
    -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-count ${NCU_N:-1200} \
    $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu_pre.csv 2> $OUT/ncu_pre.err
  echo "ncu rc=$?" >> $T; gzip -f $OUT/ncu_pre.csv
  python3 "$(dirname "$0")/ncu_step.py" $OUT/ncu_pre.csv.gz max > $OUT/ncu_pre.md 2>&1; head -36 $OUT/ncu_pre.md >> $T
fi
if [ -n "${NCU_K:-}" ]; then  # named kernels of the 8K prefill: per kernel, the mean of its largest launches
  step "ncu: $NCU_K"
  env ${NCU_ENV:-LUNAR_NONE=0} timeout 60 ncu --replay-mode application --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv -k regex:"$NCU_K" \
    --launch-count ${NCU_N:-400} $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu_k.csv 2> $OUT/ncu_k.err
  echo "ncu rc=$?" >> $T
  python3 - $OUT/ncu_k.csv >> $T <<'PY'
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
    wr = sum(d.get("dram__bytes_write.sum", 0) for d in ds) / len(ds) / 1e6
    print("%-44s %3d launches (top %d): %.1f us, read %.1f MB, write %.1f MB" % (n[:44], len(by[n]), len(ds), t, rd, wr))
PY
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=summary.txt --exclude=ncu_pre.csv.gz --exclude=ncu_pre.md -- * && rm -rf t_* b_* ev.log ncu_pre.err)
cat $T
