#!/usr/bin/env bash
# Session 12, s12-k3lat (issues 8/9), one call on one H200: the K3.1 slice's B = 1 latency kernels.
#  1. op tests: the AttnRes mix vs the CPU, the router (the rolled / unrolled / flat warp router the
#     same bytes; route-one == top-k + permute; vs the CPU)
#  2. the AttnRes op bench (LUNAR_NORM_BENCH=1: the fused kernel, glue, at 1 / 64 / 8192 rows; session 12's run also
#     had the cluster kernel, since left out of the tree: git show 0fb83a1)
#  3. Nsight Compute on one launch inside an op test (kernel replay, caches flushed), SASS-level stall samples:
#     route-one rolled (default) and unrolled (LUNAR_ROUTER=unrolled), the AttnRes mix at
#     K3's n = 1, S = 9, D = 7168 with the out-norm, the DSA top-k
#  4. the K3.1 TP8 slice's B = 1 step, $ROUNDS rounds alternating: the default against each variant of $K3AB
# (--warp-sampling-interval: SI = 0 samples every 32 cycles; run in the lead's call 1 of session 12.)
#   P=<prebuilt dir> OUT=<dir> [TESTS=...] [BENCH=0] [SPECS=...] [SI=<ncu sampling interval>] [ROUNDS=3]
#   [K3AB="A=1,B=2 C=3"] tools/device/k3lat.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=k3lat.txt . tools/device/env.sh
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10"
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
for f in ${TESTS-cuda_attnres_fused cuda_moe_route cuda_moe_router}; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
if [ "${BENCH:-1}" = 1 ]; then
  step "AttnRes op bench"
  LUNAR_NORM_BENCH=1 timeout 40 $P/bin/lunar_tests cuda_attnres_bench > $OUT/attnres_bench.log 2>&1
  echo "rc=$?" >> $T; grep -E '^\||^floor' $OUT/attnres_bench.log >> $T
fi
# name|environment|test|kernel regex|launches to skip; ncu's demangled names read
# "router_warp_kernel<(bool)1, (int)28, (int)4, (bool)1>", so '.' stands for '(', ')' and ' '
SPECS=${SPECS:-"route_rolled|LUNAR_NONE=0|cuda_moe_route_one|router_warp_kernel<.bool.1,..int.28,..int.4,..bool.1>|0;\
route_unrolled|LUNAR_ROUTER=unrolled|cuda_moe_route_one|router_warp_kernel<.bool.1,..int.28,..int.4,..bool.0>|0;\
attnres_onepass|LUNAR_NONE=0|cuda_attnres_fused|attnres_kernel<.int.32>|1;\
dsa_topk|LUNAR_NONE=0|cuda_dsa_indexer_vs_cpu|topk_kernel|0"}
IFS=';' read -r -a specs <<< "$SPECS"
for spec in "${specs[@]}"; do
  IFS='|' read -r name ev test k skip <<< "$spec"
  step "ncu $name: $test $k (skip $skip)"
  env $ev timeout 30 ncu --replay-mode kernel --kernel-name-base demangled -k "regex:$k" --launch-skip "$skip" \
    --launch-count 1 --import-source no --warp-sampling-interval ${SI:-0} --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section LaunchStats -o "$OUT/rep_$name" -f "$P/bin/lunar_tests" "$test" > "$OUT/ncu_$name.log" 2>&1
  echo "rc=$?" >> $T
  ncu -i "$OUT/rep_$name.ncu-rep" --page details > "$OUT/det_$name.txt" 2>&1
  ncu -i "$OUT/rep_$name.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_$name.csv" 2>&1
  ncu -i "$OUT/rep_$name.ncu-rep" --page raw --csv > "$OUT/raw_$name.csv" 2>&1
  grep -E 'Duration|Elapsed Cycles|SM Frequency|Executed Instructions |Warp Cycles Per Issued|Grid Size|Cluster Size' \
    "$OUT/det_$name.txt" | head -10 >> $T
  python3 "$(dirname "$0")/ncu_sass_top.py" "$OUT/sass_$name.csv" "$OUT/raw_$name.csv" 8 >> $T 2>&1
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for v in LUNAR_NONE=0 ${K3AB:-}; do
    i=$((i + 1))
    step "K3.1 slice B=1 ctx 8K $v round $r"
    env ${v//,/ } timeout 40 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 \
      --contexts 8192 --steps 64 > $OUT/k3ab_${i}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/k3ab_${i}_$r.log)" >> $T
  done
done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=k3lat.txt -- * && find . -maxdepth 1 -type f ! -name all.tgz ! -name k3lat.txt -delete)
cat $T
