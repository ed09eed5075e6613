#!/usr/bin/env bash
# Session 17, s17-dsa (issues 7 / 9): the K3.1 slice's DSA chain at B = 1. One call:
#  1. op tests: lunar_cuda_tests cuda_mla_sparse (default plan and LUNAR_MLA_SPARSE_SPLIT=32/64/100/5000 vs the CPU op;
#     1 row x 12 heads, odd top-k, top-k past the context), cuda_dsa (top-k vs a sort under the default kernel and
#     LUNAR_DSA_TOPK=agg, the indexer vs the CPU);
#  2. bench_mla sparse (device timing): LUNAR_MLA_SPARSE_SPLIT default / 128 / 64 / 32 columns; bench_mla topkab;
#  3. the K3.1 TP8 slice's B = 1 TPOT, ROUNDS rounds alternating: default / split S / split S + top-k agg, S the
#     fastest split of step 2 at H = 12, B = 1, 8K, bf16 (the slice's shape);
#  4. while time is left: lunar_tests cuda_forward_k3 under both switches.
#   P=<prebuilt dir: bin/ lib/ bd/> OUT=<dir> [ROUNDS=3] [TPOT_BEFORE=125] tools/device/dsa17.sh
# (Run once at 50f487c, copied into the pack: tar xJf .xfer-dsaz/pack.tar.xz && P=.xfer-dsa OUT=$OUT bash
# .xfer-dsa/dsa17.sh; one cold call on an H200, 64 s of command, every step ran. LUNAR_DSA_TOPK=agg and bench_mla
# topkab were dropped after it (0.50-0.80x): git show ac06c0b. Since then "default" is 32 positions a split at
# <= 16 heads, so its old plan is LUNAR_MLA_SPARSE_SPLIT=256.)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
SUMMARY=dsa17.txt . tools/device/env.sh
BD=$P/bd
before() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1
for f in cuda_mla_sparse cuda_dsa; do
  step "lunar_cuda_tests $f"
  LUNAR_TEST_VERBOSE=1 OMP_NUM_THREADS=16 timeout 60 $BD/lunar_cuda_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|differs' $OUT/t_$f.log | cut -c1-200 | tail -6 >> $T
  grep -oE 'mla sparse .* max rel err [0-9.e+-]+' $OUT/t_$f.log | awk '{print $NF}' | sort -g | tail -1 |
    sed 's/^/worst sparse rel err: /' >> $T
done

step "bench_mla sparse (device timing; split columns)"
BENCH_MLA_TIMING=dev BENCH_MLA_SPARSE_SPLITS="default 128 64 32" timeout 40 $BD/bench_mla sparse > $OUT/sparse.md 2>&1
echo "rc=$?" >> $T; grep -E '^\|' $OUT/sparse.md | grep -v -- '---' >> $T
step "bench_mla topkab (device timing)"
BENCH_MLA_TIMING=dev timeout 30 $BD/bench_mla topkab > $OUT/topk.md 2>&1
echo "rc=$?" >> $T; grep -E '^\|' $OUT/topk.md | grep -v -- '---' >> $T

# the fastest split at the slice's shape (columns: default 128 64 32)
S=$(awk -F'|' '$2+0 == 12 && $3+0 == 1 && $4 ~ /^ *8K *$/ && $5 ~ /bf16/ {
  best = 64; bt = 1e9; split("128 64 32", n, " ");
  for (i = 1; i <= 3; i++) { v = $(6 + i) + 0; if (v > 0 && v < bt) { bt = v; best = n[i] } } print best }' $OUT/sparse.md)
S=${S:-64}
echo "split for the TPOT A/B: $S" >> $T
K="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93 --load-format dummy --backend cuda \
  --input-lens 8192 --batch-sizes 1 --contexts 8192 --steps 64"
tpot() { grep -A8 "^decode " "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms (proj %s)  ", $1, $2, $3, $8}'; echo; }
V=("LUNAR_NONE=0" "LUNAR_MLA_SPARSE_SPLIT=$S" "LUNAR_MLA_SPARSE_SPLIT=$S,LUNAR_DSA_TOPK=agg")
for r in $(seq 1 "${ROUNDS:-3}"); do
  for k in 0 1 2; do
    vi=$(( (r + k) % 3 )); v=${V[$vi]}
    before ${TPOT_BEFORE:-125} || { echo "skip TPOT round $r $v (time)" >> $T; continue; }
    env ${v//,/ } timeout 30 $P/bin/lunar bench $K > $OUT/k3_${vi}_$r.log 2>&1
    echo "round $r $v rc=$? $(tpot $OUT/k3_${vi}_$r.log)" >> $T
  done
done
if before ${FWD_BEFORE:-140}; then
  step "lunar_tests cuda_forward_k3 (LUNAR_MLA_SPARSE_SPLIT=32 LUNAR_DSA_TOPK=agg)"
  LUNAR_MLA_SPARSE_SPLIT=32 LUNAR_DSA_TOPK=agg OMP_NUM_THREADS=16 timeout ${FWD_TIMEOUT:-20} $P/bin/lunar_tests cuda_forward_k3 \
    > $OUT/t_fwd.log 2>&1
  echo "rc=$?" >> $T; grep -E 'FAILED|passed, |CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
else
  echo "skip cuda_forward_k3 (time)" >> $T
fi
step done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $T 2>&1
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=dsa17.txt -- * && find . -maxdepth 1 -type f ! -name all.tgz ! -name dsa17.txt -delete)
cat $T
