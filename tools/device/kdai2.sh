#!/usr/bin/env bash
# Session 14, s14-kdai2 (issue 7), one call on one H200: mode 2's KDA state pass tilings from 66 heads
# (LUNAR_KDA_STATE old = the default there / wide / ws64 / b32 / ws32 / grp), correctness first, then timings.
# (Run at commit 07f72ce, whose bench_cuda kdastate96 timed the six tilings; since, the tree keeps old and grp only.)
#  1. op tests: lunar_tests cuda_kda_chunked (chunked vs the CPU op in every mode; the ws pass; the intra
#     kernel's fast form; cuda_kda_chunked_state_wide: each new tiling memcmp-equal to the default and
#     within the bf16 tolerance of the CPU op, H = 66, 67, 96, 97, 132, 133)
#  2. bench_cuda kdastate96: T = 8K / 64K, H = 96, the six tilings three rounds alternating (median of
#     21 / 7 repeats of the chunk profile's events), each one's o and S compared with the default's
#  3. (while under $NCU_S s) ncu of one 8K H = 96 state launch of the default and of the best tiling
# The call runs in the session's checkout, not this worktree: carry this script in the pack (cp it into P).
#   P=<prebuilt dir, bench_cuda in bin/> OUT=<dir> [NCU_S=120] bash P/kdai2.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
step "lunar_tests cuda_kda_chunked"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 80 $P/bin/lunar_tests cuda_kda_chunked > $OUT/t_kda.log 2>&1
echo "rc=$?" >> $T
# the worst error of each kind: vs the CPU op (o, S) per state variant block, intra fast vs old
python3 - $OUT/t_kda.log >> $T <<'PY'
import re, sys
worst, var = {}, 'default'
for l in open(sys.argv[1]).read().replace('\n    ', '\n').split('\n'):
    mv = re.search(r'\[state variant (\d+|-)\]', l)
    if mv: var = 'variant ' + mv.group(1) if mv.group(1) != '-' else 'default'; continue
    m = re.search(r'(kda[^\n]*?)\s+max rel err (\S+) \(tol (\S+)\)', l)
    if not m: continue
    what, e = m.group(1), float(m.group(2))
    kind = ('intra fast vs old' if 'vs old' in what else var + ' vs CPU ' + ('o' if what.endswith(': o') else 'S'))
    if kind not in worst or e > worst[kind][0]: worst[kind] = (e, what, m.group(3))
for k, (e, w, t) in sorted(worst.items()): print("worst %-26s %.3g (tol %s)  [%s]" % (k, e, t, w[:90]))
PY
grep -E 'FAILED|failed|passed, ' $OUT/t_kda.log | cut -c1-200 | tail -8 >> $T
step "bench_cuda kdastate96"
timeout 90 $P/bin/bench_cuda kdastate96 > $OUT/bench_state.md 2>&1; echo "rc=$?" >> $T
grep '^| kda state' $OUT/bench_state.md >> $T
late() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
if late ${NCU_S:-120} && command -v ncu > /dev/null; then
  for v in old grp wide; do
    step "ncu state pass 8K H=96 LUNAR_KDA_STATE=$v"
    LUNAR_KDA_STATE=$v timeout 20 ncu --replay-mode kernel --clock-control none -k regex:kda_state --launch-skip 0 --launch-count 1 \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,lts__t_bytes.sum,launch__registers_per_thread,launch__occupancy_limit_shared_mem \
      $P/bin/bench_cuda profile > $OUT/ncu_$v.log 2>&1
    echo "rc=$?" >> $T
    grep -E 'kda_state|gpu__time|inst_executed|warps_active|issue_active|bytes|registers|occupancy' $OUT/ncu_$v.log | sed 's/  */ /g' | head -12 >> $T
  done
else
  echo "(skipped: ncu, time or no ncu)" >> $T
fi
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt -delete)
cat $T
