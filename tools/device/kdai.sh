#!/usr/bin/env bash
# Session 13, s13-kdai (issues 9 and 7), one call on one H200: mode 2's KDA intra kernel, old / fast
# (LUNAR_KDA_INTRA), correctness first, then the kernel and the Kimi-Linear-48B 8K prefill, alternating.
#  1. op tests: lunar_tests cuda_kda_chunked (chunked vs the CPU op, the ws state pass, and
#     cuda_kda_chunked_intra_fast: fast vs old bit for bit but flushed sub-2^-126 values, fast vs CPU)
#  2. bench_cuda kdaintra: T = 8K / 64K, H = 32 / 96, old / fast, three rounds alternating; the two
#     forms' o, S and scratch compared at 8K
#  3. the 8K prefill: each variant of $PFAB, $ROUNDS rounds alternating (round 3 only while under $LATE_S s)
#  4. (while under $NCU_S s) ncu on bench_cuda kdaintra1: one intra launch of each form, time,
#     instructions, pipes, DRAM bytes
# The call runs in the session's checkout, not this worktree: carry this script in the pack (cp it into P).
#   P=<prebuilt dir, bench_cuda in bin/> OUT=<dir> [PFAB="LUNAR_KDA_INTRA=old LUNAR_KDA_INTRA=fast"]
#   [ROUNDS=3] [LATE_S=62] [NCU_S=72] bash P/kdai.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=kdai.txt . tools/device/env.sh
K=configs/kimi-linear-48b-a3b.json
PF="--max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader >> $T
step "lunar_tests cuda_kda_chunked"
LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_kda_chunked > $OUT/t_kda.log 2>&1; echo "rc=$?" >> $T

grep -c 'intra fast vs old' $OUT/t_kda.log >> $T
# the worst of each kind: scratch bound, o, S, and the fast form vs the CPU
python3 - $OUT/t_kda.log >> $T <<'PY'
import re, sys
worst = {}
for l in open(sys.argv[1]):
    m = re.search(r'(kda[^\n]*?)\s+max rel err (\S+) \(tol (\S+)\)', l)
    if not m: continue
    what, e = m.group(1), float(m.group(2))
    kind = ('fast vs old scratch' if 'scratch' in what else 'fast vs old o' if 'vs old' in what and what.endswith(': o')
            else 'fast vs old S' if 'vs old' in what else 'vs CPU ' + ('o' if what.endswith(': o') else 'S'))
    if kind not in worst or e > worst[kind][0]: worst[kind] = (e, what, m.group(3))
for k, (e, w, t) in sorted(worst.items()): print("worst %-22s %.3g (tol %s)  [%s]" % (k, e, t, w[:110]))
nd = [re.search(r'\((\d+) of (\d+) bf16 differ\)', l) for l in open(sys.argv[1])]
nd = [(int(m.group(1)), int(m.group(2))) for m in nd if m]
if nd: print("scratch: %d of %d cases bit-equal; bf16 differing in all: %d of %d" % (sum(a == 0 for a, b in nd), len(nd), sum(a for a, b in nd), sum(b for a, b in nd)))
PY
grep -E 'FAILED|passed, |CHECK' $OUT/t_kda.log | cut -c1-200 | tail -6 >> $T
step "bench_cuda kdaintra"
timeout 60 $P/bin/bench_cuda kdaintra > $OUT/bench_intra.md 2>&1; echo "rc=$?" >> $T; grep '^| kda intra' $OUT/bench_intra.md >> $T
pre() { grep -A4 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s %s  ", $1, $2, $NF}'
  awk '/^profile of one prefill/ {p = 1} p && NF >= 2 && $2 ~ /^[0-9.]+$/ && $1 ~ /^[a-z_]+$/ {printf "%s %s; ", $1, $2}' "$1"; }
late() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
for r in $(seq 1 "${ROUNDS:-3}"); do
  [ "$r" -ge 3 ] && ! late ${LATE_S:-62} && { echo "(skipped: prefill round $r, time)" >> $T; break; }
  i=0
  for v in ${PFAB:-LUNAR_KDA_INTRA=old LUNAR_KDA_INTRA=fast}; do
    i=$((i + 1))
    step "KL48 prefill 8K $v round $r"
    env ${v//,/ } timeout 30 $P/bin/lunar bench $K --load-format dummy --backend cuda $PF --profile > $OUT/pf_${i}_$r.log 2>&1
    echo "rc=$? $(pre $OUT/pf_${i}_$r.log)" >> $T
  done
done
if late ${NCU_S:-72}; then
  for s in 0 23; do  # kdaintra1: old's 23 launches (2 warm-up + 21), then fast's
    step "ncu bench_cuda kdaintra1, intra launch $s"
    timeout 14 ncu --replay-mode kernel --clock-control none -k regex:kda_intra2 --launch-skip $s --launch-count 1 \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum \
      $P/bin/bench_cuda kdaintra1 > $OUT/ncu_i$s.log 2>&1
    echo "rc=$?" >> $T
    grep -E 'kda_intra2|gpu__time|inst_executed|warps_active|issue_active|dram__bytes' $OUT/ncu_i$s.log | sed 's/  */ /g' | head -12 >> $T
  done
else
  echo "(skipped: ncu, time)" >> $T
fi
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=kdai.txt -- * && find . -maxdepth 1 -type f ! -name all.tgz ! -name kdai.txt -delete)
cat $T
