#!/usr/bin/env bash
# MLA decode round 11, second call (session 16): the new default (round 10's s10m choice) against round 9's (=r9) in
# Kimi-Linear's FP8 TPOT (4 rounds, ABBA), and why the st kernel ran 10-23 % longer inside the step (ncu, first call:
# B = 64, 32K 463.6 us in the step against 382.9 us in bench_mla fp8ab): clock, cycles or bytes? ncu of the step's st
# launches (eager, caches and clocks untouched) and of bench_mla fp8one at the step's context (32769: 513 tiles) with
# the same metrics.
# Run at 9ba137d (call 2, warm, 59.6 s): the TPOT rounds ran; the ncu steps did not: ncu needs device memory to replay
# a kernel for metrics that take several passes (lts__t_sector_hit_rate, dram__bytes_*), and lunar's arena takes all
# but 1 GiB (cuda_rt.cu), so the step's profile failed and hung into its timeout, and the killed process still held
# the memory when the two fp8one profiles started ("cudaSetDevice(0): out of memory"). gpu__time_duration alone (one
# pass, mla16.sh) works; for more, --replay-mode application or a smaller arena.
#   P=<dir with bin/, bd/ (bench_mla), lib/> OUT=... tools/device/mla16b.sh
set -u
P=${P:-.xfer-mla}
OUT=${OUT:-/tmp/o}
. tools/device/env.sh
BD=${BD:-$P/bd}
K=configs/kimi-linear-48b-a3b.json
before() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
M=gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
parse() {
  python3 - "$1" <<'PY'
import re, sys, statistics
cur, got = None, {}
for line in open(sys.argv[1], errors='replace'):
    m = re.search(r'(wgmma_decode_st_kernel<[^>]*>).*?\((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)', line)
    if m:
        cur = f'{m.group(1)} grid {m.group(2)}x{m.group(3)}x{m.group(4)}'
        continue
    m = re.match(r'\s+(\S+)\s+(\S+)\s+([\d.,]+)\s*$', line)
    if m and cur and ('__' in m.group(1)):
        got.setdefault(cur, {}).setdefault(f'{m.group(1)} ({m.group(2)})', []).append(float(m.group(3).replace(',', '')))
for k, d in sorted(got.items()):
    print(f'  {k}: ' + '; '.join(f'{n} {statistics.median(v):.4g} (n={len(v)})' for n, v in sorted(d.items())))
PY
}

step "TPOT: default (s10m's choice) / r9 (round 9's default), 4 rounds ABBA"
for round in 1 2 3 4; do
  for k in 0 1; do
    v=$([ $(( (round + k) % 2 )) = 1 ] && echo def || echo r9)
    before ${TPOT_BEFORE:-60} || { echo "skip TPOT $round $v (time)" >> $T; continue; }
    case $v in def) e=LUNAR_NONE=0 ;; *) e=LUNAR_MLA_WGMMA_FP8=$v ;; esac
    env $e LUNAR_MLA_WGMMA_VERBOSE=1 timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/b.log 2>&1; rc=$?
    echo "round $round $v rc=$rc: $(awk '/^decode /{f=1;next} f&&NF>=7{printf "B=%s ctx=%s %s ms; ", $1, $2, $3}' $OUT/b.log)" >> $T
    [ $round = 1 ] && grep -m3 "heads as N" $OUT/b.log | cut -c1-240 >> $T
  done
done

step "ncu: the step's st launches (default, eager, B = 8 / 64, 32K)"
timeout ${NCU_TIMEOUT:-40} ncu --clock-control none --cache-control none --print-units base --metrics $M -k regex:wgmma_decode_st \
  --launch-count 42 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 \
  --contexts 32768 --kv-cache-dtype fp8 --steps 1 --enforce-eager > $OUT/ncu_step.txt 2>&1
echo "rc=$?" >> $T
parse $OUT/ncu_step.txt >> $T
for c in "32 64 32769" "32 8 32769"; do
  before ${ONE_BEFORE:-110} || { echo "skip fp8one $c (time)" >> $T; continue; }
  step "ncu: bench_mla fp8one $c (default, L2 flushed before each call)"
  BENCH_MLA_CASE="$c" timeout 30 ncu --clock-control none --cache-control none --print-units base --metrics $M -k regex:wgmma_decode_st \
    --launch-skip 2 --launch-count 3 $BD/bench_mla fp8one > $OUT/ncu_one.txt 2>&1
  echo "rc=$?" >> $T
  grep -m1 "^fp8one" $OUT/ncu_one.txt >> $T
  parse $OUT/ncu_one.txt >> $T
  cat $OUT/ncu_one.txt >> $OUT/ncu_ones.txt
done
step done
(cd $OUT && tar czf logs.tgz ncu_step.txt ncu_ones.txt b.log 2>/dev/null && rm -f ncu_step.txt ncu_ones.txt ncu_one.txt b.log)
cat $T
