#!/usr/bin/env bash
# MLA decode, FP8 pages, round 11 (session 16; issue 7). Round 10's trace left 12-15 us "outside the blocks" at every
# shape and its =s10 read slower in Kimi-Linear's TPOT than in the kernel bench. In order (each optional step only
# while the elapsed time allows):
#  1. lunar_cuda_tests cuda_mla_wgmma: the runs of every file's kernels after the split of cuda_mla_wgmma.cu (widen,
#     q8x2, rs, rs2, s9, s9c, s10m) and round 11's s10p (memcmp-equal to stlp), LUNAR_MLA_WGMMA_VERBOSE=1;
#  2. bench_mla fp8trace, L2 flushed, as before and with BENCH_MLA_TIMING=dev (the flush by an asynchronous copy: is
#     "call - span" the host's work between the events?), with the host's time of each call;
#  3. bench_mla fp8ab (4 rotated rounds) default / s10m / s10p at the issue's shapes, device timing and as before;
#  4. Kimi-Linear-48B FP8 TPOT at B = 8 / 64, 32K: default / =s10m / =s10p, ROUNDS rounds, the order rotated;
#  5. ncu of the step's MLA kernels (wgmma_decode_st, merge_kernel; eager steps, caches and clocks untouched):
#     default and =s10m, each kernel's duration inside the model;
#  6. lunar_tests cuda_forward under LUNAR_MLA_WGMMA_FP8=s10p (the st kernel forced at every size, graphs with PDL).
#   P=<dir with bin/ (lunar, lunar_tests), bd/ (lunar_cuda_tests, bench_mla of build-device) and lib/> OUT=... \
#     tools/device/mla16.sh
# (Run at d547343, copied into the pack: tar xJf .xfer-mlaz/pack.tar.xz && P=.xfer-mla OUT=$OUT bash .xfer-mla/mla16.sh;
# one cold call, 75 s of command: every step ran.)
set -u
P=${P:-.xfer-mla}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
BD=${BD:-$P/bd}
K=configs/kimi-linear-48b-a3b.json
before() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1

step "op test cuda_mla_wgmma (widen q8x2 rs rs2 s9 s9c s10m s10p)"
LUNAR_TEST_MLA_FP8="widen q8x2 rs rs2 s9 s9c s10m s10p" LUNAR_TEST_VERBOSE=1 LUNAR_MLA_WGMMA_VERBOSE=1 OMP_NUM_THREADS=16 \
  timeout ${TEST_TIMEOUT:-55} $BD/lunar_cuda_tests cuda_mla_wgmma > $OUT/t_mla.log 2>&1
echo "rc=$?" >> $T
grep -E "passed|failed|FAIL|CHECK|bitwise" $OUT/t_mla.log | sort | uniq -c | cut -c1-170 >> $T
echo "$(grep -c "max rel err" $OUT/t_mla.log) runs reported; worst: $(grep -oE "fp8 max rel err [0-9.e-]+" $OUT/t_mla.log |
  sort -t' ' -k5 -g | tail -1)" >> $T
grep -oE "mla wgmma decode: .*" $OUT/t_mla.log | sort | uniq -c | cut -c1-220 >> $T

step "bench_mla fp8trace (s9 as before; s9, s10m with BENCH_MLA_TIMING=dev)"
BENCH_MLA_AB="s9" BENCH_MLA_L2MODES=flush timeout 30 $BD/bench_mla fp8trace > $OUT/trace.md 2>&1
echo "rc=$?" >> $T
BENCH_MLA_TIMING=dev BENCH_MLA_AB="s9 s10m" BENCH_MLA_L2MODES=flush timeout 30 $BD/bench_mla fp8trace >> $OUT/trace.md 2>&1
echo "rc=$?" >> $T
grep -E '^\||^\(BENCH' $OUT/trace.md | grep -v -- '---' >> $T

CASES="32 64 32768;32 8 131072;32 64 8192;32 8 32768;32 8 8192"
step "bench_mla fp8ab default s10m s10p (device timing, then as before)"
BENCH_MLA_TIMING=dev BENCH_MLA_AB="default s10m s10p" BENCH_MLA_CASES="$CASES" timeout 40 $BD/bench_mla fp8ab > $OUT/fp8ab.md 2>&1
echo "rc=$?" >> $T
BENCH_MLA_AB="default s10m s10p" BENCH_MLA_CASES="$CASES" timeout 40 $BD/bench_mla fp8ab >> $OUT/fp8ab.md 2>&1
echo "rc=$?" >> $T
grep -E '^\||^###' $OUT/fp8ab.md | grep -v -- '---' >> $T

step "TPOT: default / s10m / s10p, ${ROUNDS:-5} rounds, order rotated"
V=(def s10m s10p)
for round in $(seq 1 ${ROUNDS:-5}); do
  for k in 0 1 2; do
    v=${V[$(( (round + k) % 3 ))]}
    before ${TPOT_BEFORE:-120} || { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
    [ $round = 1 ] && grep -m3 "heads as N" $OUT/b.log | cut -c1-240 >> $T
    [ $round = 1 ] && cp $OUT/b.log $OUT/b_$v.log
  done
done

for v in def s10m; do
  before ${NCU_BEFORE:-150} || { echo "skip ncu $v (time)" >> $T; continue; }
  step "ncu in the step: $v (eager, B = 8 / 64, 32K; wgmma_decode_st + merge_kernel durations)"
  case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
  env $e timeout ${NCU_TIMEOUT:-45} ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    -k regex:"wgmma_decode_st|merge_kernel" --launch-count 90 $P/bin/lunar bench $K --load-format dummy --backend cuda \
    --input-lens 1024 --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 --steps 2 --enforce-eager \
    > $OUT/ncu_$v.txt 2>&1
  echo "rc=$?" >> $T
  python3 - $OUT/ncu_$v.txt >> $T <<'PY'
import re, sys, statistics
cur, got = None, {}
for line in open(sys.argv[1], errors='replace'):
    m = re.search(r'(wgmma_decode_st_kernel<[^>]*>|merge_kernel).*?\((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)', line)
    if m:
        cur = (m.group(1), f'grid {m.group(2)}x{m.group(3)}x{m.group(4)}')
        continue
    m = re.search(r'gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)', line)
    if m and cur:
        v = float(m.group(2).replace(',', ''))
        v = v / 1000 if m.group(1) == 'nsecond' else v * 1000 if m.group(1) == 'msecond' else v
        got.setdefault(cur, []).append(v)
        cur = None
for k, v in sorted(got.items()):
    print(f'  {k[0]} {k[1]}: n={len(v)} median {statistics.median(v):.1f} us, min {min(v):.1f}, max {max(v):.1f}')
PY
done

if before ${FWD_BEFORE:-165}; then
  step "lunar_tests cuda_forward under LUNAR_MLA_WGMMA_FP8=s10p"
  LUNAR_MLA_WGMMA_FP8=s10p OMP_NUM_THREADS=16 timeout ${FWD_TIMEOUT:-35} $P/bin/lunar_tests cuda_forward > $OUT/fwd.log 2>&1
  echo "rc=$?" >> $T
  grep -E "passed|failed|FAIL" $OUT/fwd.log | tail -12 | cut -c1-200 >> $T
else
  echo "skip cuda_forward (time)" >> $T
fi
step done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1
(cd $OUT && tar czf logs.tgz t_mla.log b_*.log ncu_*.txt fwd.log 2>/dev/null && rm -f t_mla.log b.log b_*.log ncu_*.txt fwd.log)
cat $T
