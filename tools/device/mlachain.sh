#!/usr/bin/env bash
# The MLA split merge fused into the decode kernel (LUNAR_MLA_MERGE=fused), not yet measured at the merge
# kernel's own split count (LUNAR_MLA_FUSE_SPLITS=0): its test, graphs == eager, bench_mla merge (kernel
# alone: split + merge kernel, fused at the same splits, caps 8 / 32) and the Kimi-Linear step A/B at 1K and 32K
# (docs/benchmarks.md "Decode B = 1: the MLA chain (session 7, H200)"). ~45 s on one H200.
#   P=<prebuilt dir with bin/, lib/, bd/bench_mla> OUT=... tools/device/mlachain.sh
set -u
P=${P:-.xfer-mlab1}
OUT=${OUT:-/tmp/o}
SUMMARY=s.txt . tools/device/env.sh
step "FUSE_SPLITS=0 lunar_tests cuda_mla_fused"
LUNAR_MLA_FUSE_SPLITS=0 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_mla_fused > $OUT/t1.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t1.log | cut -c1-160 | tail -4 >> $T
step "FUSE_SPLITS=0 lunar_tests cuda_forward_graphs"
LUNAR_MLA_MERGE=fused LUNAR_MLA_FUSE_SPLITS=0 OMP_NUM_THREADS=16 timeout 40 $P/bin/lunar_tests cuda_forward_graphs > $OUT/t2.log 2>&1; echo "rc=$?" >> $T
grep -E 'FAILED|passed, |CHECK' $OUT/t2.log | cut -c1-160 | tail -4 >> $T
step "bench_mla merge"
timeout 40 $P/bd/bench_mla merge > $OUT/bench_merge.md 2>&1; echo "rc=$?" >> $T
grep '^|' $OUT/bench_merge.md >> $T
K=configs/kimi-linear-48b-a3b.json
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
for r in 1 2; do
  for v in LUNAR_NONE=0 "LUNAR_MLA_MERGE=fused LUNAR_MLA_FUSE_SPLITS=0"; do
    n=$(echo $v | tr -c 'A-Za-z0-9=\n' _ | tr = _)
    step "KL48 1K $v round $r"
    env $v timeout 40 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 \
      --batch-sizes 1,8 --contexts 1024 --steps 64 > $OUT/ab_${n}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/ab_${n}_$r.log)" >> $T
  done
done
step "KL48 32K FUSE_SPLITS=0"
LUNAR_MLA_MERGE=fused LUNAR_MLA_FUSE_SPLITS=0 timeout 60 $P/bin/lunar bench $K --load-format dummy --backend cuda --max-len 36864 --input-lens 1024 \
    --batch-sizes 1,8 --contexts 32768 --steps 64 > $OUT/l32.log 2>&1
echo "rc=$? $(tpot $OUT/l32.log)" >> $T
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=s.txt -- * && rm -f t1* t2* ab_* l32*)
cat $T
