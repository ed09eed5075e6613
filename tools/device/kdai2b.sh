#!/usr/bin/env bash
# Session 14, s14-kdai2, call 2 (one H200): LUNAR_KDA_STATE=grp2 (grp with two barriers a chunk) against the
# default and grp at H = 96, correctness first.
#  1. lunar_tests cuda_kda_chunked_state (state_wide: every tiling incl. grp2 memcmp-equal to the default and
#     within the bf16 tolerance of the CPU op; state_ws)
#  2. bench_cuda kdastate96b: T = 8K / 64K, H = 96, old / grp / grp2, three rounds alternating
#  3. (while under $NCU_S s) ncu of one 8K H = 96 state launch of grp2
#   P=<prebuilt dir> OUT=<dir> [NCU_S=60] bash P/kdai2b.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
step "lunar_tests cuda_kda_chunked_state"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_kda_chunked_state > $OUT/t_kda.log 2>&1
echo "rc=$?" >> $T
python3 - $OUT/t_kda.log >> $T <<'PY'
import re, sys
worst, var = {}, 'default'
for l in open(sys.argv[1]).read().replace('\n    ', '\n').split('\n'):
    mv = re.search(r'\[state variant (\d+|-)\]', l)
    if mv: var = 'variant ' + mv.group(1) if mv.group(1) != '-' else 'default'; continue
    m = re.search(r'(kda[^\n]*?)\s+max rel err (\S+) \(tol (\S+)\)', l)
    if not m: continue
    what, e = m.group(1), float(m.group(2))
    kind = var + ' vs CPU ' + ('o' if what.endswith(': o') else 'S')
    if kind not in worst or e > worst[kind][0]: worst[kind] = (e, what, m.group(3))
for k, (e, w, t) in sorted(worst.items()): print("worst %-26s %.3g (tol %s)  [%s]" % (k, e, t, w[:90]))
PY
grep -E 'FAILED|failed|passed, ' $OUT/t_kda.log | cut -c1-200 | tail -8 >> $T
step "bench_cuda kdastate96b"
timeout 60 $P/bin/bench_cuda kdastate96b > $OUT/bench_state.md 2>&1; echo "rc=$?" >> $T
grep '^| kda state' $OUT/bench_state.md >> $T
if [ $(( $(date +%s) - t0 )) -lt ${NCU_S:-60} ] && command -v ncu > /dev/null; then
  step "ncu state pass 8K H=96 LUNAR_KDA_STATE=grp2"
  LUNAR_KDA_STATE=grp2 timeout 20 ncu --replay-mode kernel --clock-control none -k regex:kda_state --launch-skip 0 --launch-count 1 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,launch__registers_per_thread \
    $P/bin/bench_cuda profile > $OUT/ncu_grp2.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'kda_state|gpu__time|inst_executed|warps_active|issue_active|bytes|registers' $OUT/ncu_grp2.log | sed 's/  */ /g' | head -10 >> $T
fi
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt -delete)
cat $T
