#!/usr/bin/env bash
# session 6, call 3 (one H200): main after the first round's merges (moepre, mladec, prefill, decpdl; moedec history
# only) + the KDA prefill o placement: check.sh tests, model-level CUDA tests, A/B of PDL prefetch, FP8 MLA selection,
# the KDA prefill profile fused vs split, and an ncu per-kernel table of one KL48 B=1 decode step.
set -u
P=${P:-.xfer-v7}
OUT=${OUT:-/tmp/o}
SUMMARY=v3.txt . tools/device/env.sh
step "check.sh tests"
SKIP_BUILD=1 PREBUILT=$P OPS_TIMEOUT=120 ENGINE_TIMEOUT=45 OUT=$OUT/check timeout 200 tools/device/check.sh tests > $OUT/check.log 2>&1
echo "check.sh rc=$?" >> $T; cat $OUT/check/table.txt >> $T 2>/dev/null
for f in cuda_forward cuda_mla cuda_moe_ cuda_kda ptpc cuda_dcp; do
  step "lunar_tests $f"
  OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1; echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK' $OUT/t_$f.log | cut -c1-200 | tail -4 >> $T
done
K=configs/kimi-linear-48b-a3b.json
S="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s  ", $1, $2, $4}'; echo; }
for r in 1 2; do
  for pf in 0 2; do
    step "KL48 decode prefetch=$pf round $r"
    LUNAR_PDL_PREFETCH=$pf timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 1024 --steps 32 > $OUT/kl_pf${pf}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/kl_pf${pf}_$r.log)" >> $T
    step "K3.1 slice decode prefetch=$pf round $r"
    LUNAR_PDL_PREFETCH=$pf timeout 90 $P/bin/lunar bench $S --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 1,8,64 --contexts 8192 --steps 32 > $OUT/k3_pf${pf}_$r.log 2>&1
    echo "rc=$? $(tpot $OUT/k3_pf${pf}_$r.log)" >> $T
  done
done
for e in default new; do
  step "KL48 FP8 cache, MLA decode $e"
  env $( [ $e = new ] && echo LUNAR_MLA_DECODE=new ) timeout 120 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 1024 --batch-sizes 8,64 --contexts 32768 --kv-cache-dtype fp8 > $OUT/fp8_$e.log 2>&1
  echo "rc=$? $(tpot $OUT/fp8_$e.log)" >> $T
done
for m in fused split fused; do
  step "KL48 8K prefill profile, KDA $m"
  LUNAR_KDA_PREFILL=$m timeout 90 $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 2 --profile > $OUT/pre_$m.log 2>&1
  echo "rc=$?" >> $T; grep -E '^ +8192|kda_|experts|mla_attn' $OUT/pre_$m.log | grep -v decode | head -8 >> $T
done
step "ncu: one KL48 B=1 decode step, per kernel (application replay)"
timeout 150 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-skip 0 --launch-count 3000 \
  $P/bin/lunar bench $K --load-format dummy --backend cuda --input-lens 16 --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/ncu_dec.csv 2> $OUT/ncu_dec.err
echo "ncu rc=$? lines $(wc -l < $OUT/ncu_dec.csv)" >> $T; tail -3 $OUT/ncu_dec.err >> $T
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=v3.txt --exclude=ncu_dec.csv -- *)
cat $T
