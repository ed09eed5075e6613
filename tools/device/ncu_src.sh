#!/usr/bin/env bash
# Where a small decode kernel's time goes, instruction by instruction: Nsight Compute on one launch inside an op
# test (application replay: the test's small arena, not a model's pools), sections SpeedOfLight, WarpStateStats,
# SourceCounters (per-SASS-instruction stall samples), InstructionStats, SchedulerStats; the report, its details
# page and its SASS page (CSV) come back.
# (Written in session 11 for the route-one and AttnRes kernels of the K3.1 slice; not yet run: no device time was left.)
#   P=<prebuilt dir> OUT=<dir> [SPECS="test|kernel regex|skip;..."] tools/device/ncu_src.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=ncu_src.txt . tools/device/env.sh
# SPECS: entries "test|kernel regex|launches to skip" separated by ';' (the regexes use '.' for a space)
IFS=';' read -r -a specs <<< "${SPECS:-cuda_moe_route_one|router_warp_kernel<[^,]*,.28|0;cuda_attnres_fused|attnres_kernel<32>|1}"
for spec in "${specs[@]}"; do
  IFS='|' read -r test k skip <<< "$spec"
  step "ncu $test: $k (skip $skip)"
  timeout 100 ncu --replay-mode application --kernel-name-base demangled -k "regex:$k" --launch-skip "$skip" \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section InstructionStats --section SchedulerStats -o "$OUT/rep_$test" -f "$P/bin/lunar_tests" "$test" \
    > "$OUT/ncu_$test.log" 2>&1
  echo "rc=$?" >> $T; tail -2 "$OUT/ncu_$test.log" >> $T
  ncu -i "$OUT/rep_$test.ncu-rep" --page details > "$OUT/det_$test.txt" 2>&1
  ncu -i "$OUT/rep_$test.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_$test.csv" 2>&1
  grep -E 'Duration|Elapsed Cycles|SM Frequency|Executed Instructions |Issued Warp|No Eligible|Warp Cycles Per Issued' \
    "$OUT/det_$test.txt" | head -12 >> $T
  wc -l "$OUT/sass_$test.csv" >> $T
done
step done
cat $T
