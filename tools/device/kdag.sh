#!/usr/bin/env bash
# Session 13, s13-kdag (issue 9), one call on one H200: the KDA gate GEMM of the Kimi-Linear-48B 8K prefill,
# then a first look at the MLA flash kernel's stalls.
#  1. op tests: cuda_kda (cuda_kda_gate_gemm_vs_cpu runs the three gate forms: exact, sfu, loop),
#     cuda_forward under LUNAR_KDA_GATE=$FWD_FORM (the goldens, graphs == eager, vs the CPU)
#  2. bench_cuda kdagate: the three forms at 8K and 32K tokens (H = 32, in = 128), three rounds alternating
#  3. Nsight Compute on bench_cuda kdagate1 (one 8K call a form; kernel replay): time, DRAM bytes, the pipes,
#     SASS stall samples (SourceCounters), per form
#  4. the 8K prefill: LUNAR_NONE=0 (the defaults) and each variant of $PFAB, $ROUNDS rounds alternating
#  5. (while the command is under $LATE_S s) ncu on the 8K prefill's gate kernels, the default and $NCU_FORM
#  6. (FLASH=1, likewise) ncu SourceCounters on one flash_pp_kernel launch (bench_mla prefill: H = 32, n = 8192);
#     in session 13's call kernel replay stayed at 'Profiling flash_pp_kernel: 0%' for the whole 60 s
# The call runs in the session's checkout, not this worktree: carry this script in the pack (cp it into P).
#   P=<prebuilt dir, with bench_cuda and bench_mla in bin/> OUT=<dir> [PFAB="A=1 B=2,C=3"] [ROUNDS=3]
#   [FWD_FORM=loop] [NCU_FORM=loop] [LATE_S=100] [FLASH=1] bash P/kdag.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=kdag.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
step "lunar_tests cuda_kda"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_kda > $OUT/t_kda.log 2>&1; echo "rc=$?" >> $T
grep -E 'kda_gate_gemm' $OUT/t_kda.log | sed 's/^ *//' | cut -c1-110 >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t_kda.log | cut -c1-200 | tail -6 >> $T
step "lunar_tests cuda_forward (LUNAR_KDA_GATE=${FWD_FORM:-loop})"
LUNAR_KDA_GATE=${FWD_FORM:-loop} OMP_NUM_THREADS=16 timeout 90 $P/bin/lunar_tests cuda_forward > $OUT/t_fwd.log 2>&1
echo "rc=$?" >> $T; grep -E 'FAILED|passed, |CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -6 >> $T
step "bench_cuda kdagate"
timeout 60 $P/bin/bench_cuda kdagate > $OUT/bench_gate.md 2>&1; echo "rc=$?" >> $T; grep -A8 '^| kda gate' $OUT/bench_gate.md >> $T
for f in 0 1 2; do
  step "ncu bench_cuda kdagate1, form $f"
  timeout 40 ncu --replay-mode kernel --clock-control none -k regex:kda_gate_gemm --launch-skip $f --launch-count 1 \
    --import-source no --warp-sampling-interval 0 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum -o "$OUT/rep_g$f" -f $P/bin/bench_cuda kdagate1 > $OUT/ncu_g$f.log 2>&1
  echo "rc=$?" >> $T
  ncu -i "$OUT/rep_g$f.ncu-rep" --page details > "$OUT/det_g$f.txt" 2>&1
  ncu -i "$OUT/rep_g$f.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_g$f.csv" 2>&1
  ncu -i "$OUT/rep_g$f.ncu-rep" --page raw --csv > "$OUT/raw_g$f.csv" 2>&1
  grep -E '^  [a-z_]+kernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Executed Ipc A|Warp Cycles Per Issued|Achieved Occupancy|dram__bytes|Grid Size|Registers Per' \
    "$OUT/det_g$f.txt" | head -14 >> $T
  grep -iE 'pipe|Utilization' "$OUT/det_g$f.txt" | head -6 >> $T
  python3 tools/device/ncu_sass_top.py "$OUT/sass_g$f.csv" "$OUT/raw_g$f.csv" 6 >> $T 2>&1
done
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && NF >= 2 && $2 ~ /^[0-9.]+$/ && $1 ~ /^[a-z_]+$/ {printf "%s %s; ", $1, $2}' "$1"; }
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${PFAB:-}; do
    i=$((i + 1))
    step "KL48 prefill 8K $v round $r"
    env ${v//,/ } timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF --profile > $OUT/pf_${i}_$r.log 2>&1
    echo "rc=$? $(pre $OUT/pf_${i}_$r.log)" >> $T
  done
done
late() { [ $(( $(date +%s) - t0 )) -lt ${LATE_S:-100} ]; }
for v in LUNAR_NONE=0 LUNAR_KDA_GATE=${NCU_FORM:-loop}; do
  late || { echo "(skipped: ncu prefill $v, time)" >> $T; continue; }
  step "ncu: the 8K prefill's kda_gate kernels, $v"
  env $v timeout 40 ncu --replay-mode application --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv -k regex:'kda_gate' \
    --launch-count 100 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF > $OUT/ncu_k.csv 2> $OUT/ncu_k.err
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
done
if [ "${FLASH:-0}" = 1 ] && late; then
  step "ncu: flash_pp_kernel (bench_mla prefill, H = 32, n = 8192), SourceCounters"
  timeout 60 ncu --replay-mode kernel --clock-control none -k regex:flash_pp --launch-count 1 --import-source no \
    --warp-sampling-interval 0 --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
    --section Occupancy -o "$OUT/rep_fl" -f $P/bin/bench_mla prefill > $OUT/ncu_fl.log 2>&1
  echo "rc=$?" >> $T
  ncu -i "$OUT/rep_fl.ncu-rep" --page details > "$OUT/det_fl.txt" 2>&1
  ncu -i "$OUT/rep_fl.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_fl.csv" 2>&1
  ncu -i "$OUT/rep_fl.ncu-rep" --page raw --csv > "$OUT/raw_fl.csv" 2>&1
  grep -E 'Duration|SM Frequency|Executed Ipc A|Warp Cycles Per Issued|Achieved Occupancy|Grid Size|Registers Per' \
    "$OUT/det_fl.txt" | head -8 >> $T
  python3 tools/device/ncu_sass_top.py "$OUT/sass_fl.csv" "$OUT/raw_fl.csv" 12 >> $T 2>&1
elif [ "${FLASH:-0}" = 1 ]; then
  echo "(skipped: flash ncu, time)" >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=kdag.txt -- * && find . -maxdepth 1 -type f ! -name all.tgz ! -name kdag.txt -delete)
cat $T
