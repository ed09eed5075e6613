#!/usr/bin/env bash
# Session 15, s15-kdai3 (issue 7), one call on one H200: the KDA intra kernel's new form (tc, the default
# since; LUNAR_KDA_INTRA=fast the session-13 one), correctness first, then timings.
# (Run at commit 26fbea0, whose kernel had four forms: fast, diag, diaginv (= tc), diaginv3; the slower
# diag / diaginv3 are out of the tree since, and the loops below name fast / tc.)
#  1. op tests: lunar_tests cuda_kda_chunked (chunked vs the CPU op in every mode, the state passes, the
#     intra fast form, cuda_kda_chunked_intra_diag: each new form vs fast and vs the CPU op, tiles past
#     the gate bound falling back in the same launch)
#  2. bench_cuda kdadiag: T = 8K / 64K, H = 96 / 32, fast / tc alternating, ROUNDS
#     rounds (median of 21 / 7 repeats of the chunk profile's events; o, S, scratch vs fast at 8K)
#  3. (while under $PF_S s) bench_cuda prefill2 (the whole op, mode 2) per form, alternating processes
#  4. (while under $NCU_S s) ncu of one 8K H = 96 intra launch of fast and of tc
# The call runs in the session's checkout, not this worktree: carry this script in the pack (cp it into P).
#   P=<prebuilt dir: bin/lunar_tests, bd/bench_cuda, lib/> OUT=<dir> [ROUNDS=3 PF_S=150 NCU_S=170] bash P/kdai3.sh
# (knobs for a short call: TESTS=filter TEST_S BENCH_S PF_ROUNDS NCU_V='1 2' NCU_T)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=summary.txt . tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
late() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
step "lunar_tests ${TESTS:-cuda_kda_chunked}"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout ${TEST_S:-150} $P/bin/lunar_tests ${TESTS:-cuda_kda_chunked} > $OUT/t_kda.log 2>&1
echo "rc=$?" >> $T
# the worst error of each kind: the intra forms vs fast, vs the CPU op
python3 - $OUT/t_kda.log >> $T <<'PY'
import re, sys
worst = {}
for l in open(sys.argv[1]).read().replace('\n    ', '\n').split('\n'):
    m = re.search(r'(kda[^\n]*?)\s+max rel err (\S+) \(tol (\S+)\)', l)
    if not m: continue
    what, e = m.group(1), float(m.group(2))
    mv = re.match(r'kda intra (\d) vs fast', what)
    if mv: kind = 'intra %s vs fast %s' % (mv.group(1), what.split(':')[-1].strip()[:7])
    elif 'vs old' in what: kind = 'intra fast vs old'
    else: kind = 'vs CPU ' + ('o' if what.endswith(': o') else 'S')
    if kind not in worst or e > worst[kind][0] or e != e: worst[kind] = (e, what, m.group(3))
for k, (e, w, t) in sorted(worst.items()): print("worst %-26s %.3g (tol %s)  [%s]" % (k, e, t, w[:100]))
PY
grep -E 'FAILED|failed|passed, ' $OUT/t_kda.log | cut -c1-200 | tail -8 >> $T
step "bench_cuda kdadiag"
ROUNDS=${ROUNDS:-3} timeout ${BENCH_S:-120} $P/bd/bench_cuda kdadiag > $OUT/bench_diag.md 2>&1; echo "rc=$?" >> $T
grep '^| kda intra' $OUT/bench_diag.md >> $T
if late ${PF_S:-150}; then
  step "bench_cuda prefill2, fast / tc alternating"
  for r in $(seq ${PF_ROUNDS:-2}); do
    for v in fast tc; do
      late ${PF_S:-150} || break
      echo "-- round $r LUNAR_KDA_INTRA=$v" >> $OUT/bench_pf.md
      LUNAR_KDA_INTRA=$v timeout 30 $P/bd/bench_cuda prefill2 >> $OUT/bench_pf.md 2>&1
      echo "-- round $r LUNAR_KDA_INTRA=$v rc=$?" >> $OUT/bench_pf.md
    done
  done
  grep -E '^-- round [0-9] LUNAR_KDA_INTRA=[a-z0-9]+$|^\| kda prefill' $OUT/bench_pf.md >> $T
else
  echo "(skipped: prefill2, time)" >> $T
fi
if late ${NCU_S:-170} && command -v ncu > /dev/null; then
  for v in ${NCU_V:-1 2}; do
    late ${NCU_S:-170} || break
    step "ncu intra 8K H=96 kda_intra2_kernel<$v>"
    timeout ${NCU_T:-25} ncu --replay-mode kernel --clock-control none --kernel-name-base mangled -k regex:"kda_intra2_kernelILi${v}E" --launch-skip 0 --launch-count 1 \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio \
      $P/bd/bench_cuda kdadiag1 > $OUT/ncu_$v.log 2>&1
    echo "rc=$?" >> $T
    grep -E 'kda_intra2|__' $OUT/ncu_$v.log | sed 's/  */ /g' | head -24 >> $T
  done
else
  echo "(skipped: ncu, time or no ncu)" >> $T
fi
step done
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt -- * && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt -delete)
cat $T
