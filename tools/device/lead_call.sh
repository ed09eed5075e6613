#!/usr/bin/env bash
# The lead's call of a session (one H200; session 17's last call, generalised in session 19): main's prebuilt
# binaries, each step optional.
#  1. (SESSION=1, the default) tools/device/session.sh: check.sh tests (every CUDA op vs its CPU op, the goldens
#     end to end, engine / generate / serve on CUDA), the dummy loader and NCCL world-1 tests, the norm bench,
#     issue 9's table (Kimi-Linear-48B prefill 1K / 8K / 32K and decode B = 1 / 8 / 32 / 64; the K3.1 TP8 slice)
#  2. A / B rounds of switches, each against the default in the same process or run alternating: TESTS (extra
#     lunar_tests filters, each "filter[:ENV=v,ENV=v]"), F16AB_V (the one-token MXFP4 pair, LUNAR_MOE_BENCH_V),
#     MLA_AB (bench_mla fp8ab variants, device timing), BENCH_CUDA (a bench_cuda mode), MLA_SPARSE=1 (bench_mla sparse, device timing), KLAB / K31AB / K31FAB (switch sets for the Kimi-Linear-48B
#     B = 1, the K3.1 slice B = 1 (K31AB_LAYERS layers, default 10) and the full K3.1 layer shape B = 1 (K31F_LAYERS layers, default 4, projected to
#     93: the only one-GPU config with K3.1's whole expert matrices) TPOT, ROUNDS (or AB_ROUNDS) rounds alternating with the default;
#     a variant's LUNAR_BIN=path runs that lunar binary: an older build against this one in the same rounds;
#     KLAB_BATCHES / K31AB_BATCHES: the batch sizes of those A/Bs, default 1)
#  3. (K31_TABLE=1) the K3.1 slice's rows of issue 9's table (K31_LAYERS layers) without the session;
#     (NCU_KL=1) the per-kernel table of one Kimi-Linear-48B B = 1 decode step (ncu, tools/device/ncu_step.py),
#     (NCU_K31=1) the same for one K3.1 TP8 slice step (10 layers, 8K context; NCU_K31_BATCH rows, default 1)
#     (TRACE_KL=B,B.. / TRACE_K31=B,B..) the graphed decode steps' kernel timeline at those batch sizes (CUPTI,
#     tools/device/kernel_trace.c + timeline.py: kernels as they ran, PDL overlap and side stream included),
#     beside the same bench untraced (the trace's own cost); TRACE_KL_V / TRACE_K31_V="name:ENV=v,.. ..": B = 1
#     timelines of switch sets (TRACE_LINES of each table into the summary, default 58)
#  4. Kimi-Linear-48B 8K prefill, PF_ROUNDS more rounds (the MFU line of issue 9)
#   P=<prebuilt dir> OUT=<dir> [SESSION=0] [TESTS=...] [F16AB_V=...] ... bash tools/device/lead_call.sh
#   (build-device/ from the pack's bd/)
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
mkdir -p build-device && cp -a "$P"/bd/. build-device/
# (TESTS is this script's list of extra filters: check.sh, inside session.sh, reads the same name as its own)
[ "${SESSION:-1}" = 1 ] && TESTS= SERVE=0 CUDA_TP=0 INPUT_LENS=1024,8192,32768 BATCHES=1,8,32,64 CONTEXTS=1024 \
  BENCH_FLAGS="--max-len 36864 --steps 64" K31_INPUT_LENS=8192 K31_BATCHES=1,8,64 K31_CONTEXTS=8192 \
  OUT=$OUT/s bash tools/device/session.sh "$P" > /dev/null 2>&1
SUMMARY=ab.txt . tools/device/env.sh
for t in ${TESTS:-}; do
  f=${t%%:*}; e=; [ "$f" != "$t" ] && e=${t#*:}
  step "lunar_tests $f ${e:+($e)}"
  env $(echo "$e" | tr ',' ' ') OMP_NUM_THREADS=16 timeout 150 $P/bin/lunar_tests $f > $OUT/t_$f.log 2>&1
  echo "rc=$? $(grep -E '^[0-9]+ passed' $OUT/t_$f.log) $(grep -E 'FAILED|CHECK' $OUT/t_$f.log | head -3 | cut -c1-160 | tr '\n' ' ')" >> $T
  grep -E 'max rel err|WG|wg' $OUT/t_$f.log | cut -c1-160 | tail -4 >> $T
done
[ -n "${F16AB_V:-}" ] && {
  step "decode pair at one token, path 16: $F16AB_V"
  LUNAR_MOE_BENCH=f16ab LUNAR_MOE_BENCH_V="$F16AB_V" LUNAR_MOE_BENCH_ROUNDS=${ROUNDS:-3} timeout 120 \
    $P/bin/lunar_tests cuda_moe_bench > $OUT/f16ab.log 2>&1; echo "rc=$?" >> $T
  grep -E '^\||mean|one token|FAILED|CHECK' $OUT/f16ab.log | grep -v '^|---' | sed -E 's/LUNAR_MOE_F16_//g' >> $T
}
[ -n "${MLA_AB:-}" ] && {
  step "bench_mla fp8ab (dev timing): $MLA_AB"
  BENCH_MLA_TIMING=dev BENCH_MLA_AB="$MLA_AB" timeout 120 build-device/bench_mla fp8ab > $OUT/mla_ab.log 2>&1
  echo "rc=$?" >> $T; grep -E '^\||mean|floor' $OUT/mla_ab.log | grep -v '^|---' | tail -30 >> $T
}
[ "${MLA_SPARSE:-0}" = 1 ] && {
  step "bench_mla sparse (dev timing)"
  BENCH_MLA_TIMING=dev timeout 120 build-device/bench_mla sparse > $OUT/mla_sparse.log 2>&1
  echo "rc=$?" >> $T; grep -E '^\|' $OUT/mla_sparse.log | grep -v '^|---' | tail -30 >> $T
}
[ -n "${BENCH_CUDA:-}" ] && {  # a bench_cuda mode (e.g. gemvmma, with GEMV_NS and ROUNDS)
  step "bench_cuda $BENCH_CUDA"
  timeout ${BENCH_CUDA_T:-150} build-device/bench_cuda $BENCH_CUDA > $OUT/bench_cuda.log 2>&1
  echo "rc=$?" >> $T; grep -E '^\|' $OUT/bench_cuda.log | grep -v '^|---' >> $T
}
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
ab() {  # ab NAME "command" "variants"
  local name=$1 cmd=$2 vs="def:LUNAR_NONE=0 $3"
  for r in $(seq 1 "${AB_ROUNDS:-${ROUNDS:-3}}"); do
    local order=$vs; [ $((r % 2)) = 0 ] && order=$(echo $vs | tr ' ' '\n' | tac | tr '\n' ' ')
    for v in $order; do
      # a variant's LUNAR_BIN=path runs that lunar binary instead of the pack's (an older build, same command)
      local c=$cmd b=$(echo "${v#*:}" | tr ',' '\n' | sed -n 's/^LUNAR_BIN=//p')
      [ -n "$b" ] && c=${cmd/$P\/bin\/lunar/$b}
      env $(echo "${v#*:}" | tr ',' ' ') timeout ${AB_T:-60} $c > $OUT/${name}_${v%%:*}_$r.log 2>&1
      echo "rc=$? $name ${v%%:*} r$r $(tpot $OUT/${name}_${v%%:*}_$r.log)" >> $T
    done
  done
}
[ -n "${KLAB:-}" ] && { step "KL48 B = 1 TPOT A/B: $KLAB"
  ab kl "$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --batch-sizes ${KLAB_BATCHES:-1} --contexts 1024 --steps 64" "$KLAB"; }
[ -n "${K31AB:-}" ] && { step "K3.1 TP8 slice B = 1 TPOT A/B: $K31AB"
  ab k31 "$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers ${K31AB_LAYERS:-10} --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes ${K31AB_BATCHES:-1} --contexts 8192 --steps 64" "$K31AB"; }
[ -n "${K31FAB:-}" ] && { step "K3.1 full layer shape, ${K31F_LAYERS:=4} layers, B = 1 TPOT A/B: $K31FAB"
  AB_T=120 ab k31f "$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --num-layers $K31F_LAYERS --project-layers 93 --backend cuda --input-lens 1024 --batch-sizes 1 --contexts 1024 --steps 32" "$K31FAB"; }
[ "${K31_TABLE:-0}" = 1 ] && {  # the K3.1 slice's rows of issue 9's table (session.sh's step 4) without the session
  step "lunar bench: Kimi-K3.1 Pro TP8 rank slice, ${K31_LAYERS:=10} layers projected to 93"
  timeout 150 $P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers $K31_LAYERS \
    --project-layers 93 --backend cuda --input-lens 8192 --batch-sizes 1,8,64 --contexts 8192 --json $OUT/k31.json \
    > $OUT/k31_table.txt 2>&1
  echo "rc=$?" >> $T; cat $OUT/k31_table.txt >> $T
}
[ "${NCU_KL:-0}" = 1 ] && {  # one Kimi-Linear-48B B = 1 decode step under ncu, eager, each kernel alone (no PDL overlap)
  step "ncu: one KL48 B = 1 decode step, per kernel"
  timeout 150 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    --csv -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-count 3000 \
    $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 16 \
    --batch-sizes 1 --contexts 1024 --steps 1 > $OUT/ncu_kl.csv 2> $OUT/ncu_kl.err
  echo "ncu rc=$?" >> $T; tail -2 $OUT/ncu_kl.err >> $T; gzip $OUT/ncu_kl.csv
  python3 tools/device/ncu_step.py $OUT/ncu_kl.csv.gz -3 > $OUT/ncu_kl.md 2>&1; head -45 $OUT/ncu_kl.md >> $T
}
[ "${NCU_K31:-0}" = 1 ] && {  # the same for one K3.1 TP8 slice decode step (10 layers, 8K context; NCU_K31_BATCH, 1)
  step "ncu: one K3.1 slice B = ${NCU_K31_BATCH:-1} decode step, per kernel"
  timeout 150 ncu --replay-mode application --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    --csv -k regex:'^(?!k_bf16|k_f32|k_mxfp4|k_packed|k_scale)' --launch-count 3000 \
    $P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --backend cuda \
    --input-lens 16 --batch-sizes ${NCU_K31_BATCH:-1} --contexts 8192 --steps 1 > $OUT/ncu_k31.csv 2> $OUT/ncu_k31.err
  echo "ncu rc=$?" >> $T; tail -2 $OUT/ncu_k31.err >> $T; gzip $OUT/ncu_k31.csv
  python3 tools/device/ncu_step.py $OUT/ncu_k31.csv.gz -3 > $OUT/ncu_k31.md 2>&1; head -45 $OUT/ncu_k31.md >> $T
}
trace() {  # trace NAME BATCH "bench command without --batch-sizes" [ENV=v,ENV=v]
  local f=$OUT/trace_$1_b$2 e=$(echo "${4:-}" | tr ',' ' ')
  step "kernel timeline: $1 B = $2 ${4:-}"
  env $e timeout 120 $3 --batch-sizes $2 > $f.plain.log 2>&1; echo "rc=$? untraced: $(tpot $f.plain.log)" >> $T
  env $e CUDA_INJECTION64_PATH=$P/lib/libkernel_trace.so KERNEL_TRACE_OUT=$f.csv timeout 150 $3 --batch-sizes $2 \
    > $f.log 2>&1; echo "rc=$? traced: $(tpot $f.log) $(grep kernel_trace $f.log | tail -1)" >> $T
  python3 tools/device/timeline.py $f.csv --steps 16 --seq --top 45 > $f.md 2>&1; head -${TRACE_LINES:-58} $f.md >> $T
  gzip -f $f.csv
}
KLB="$P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda --input-lens 1024 --contexts 1024 --steps 64"
K31B="$P/bin/lunar bench configs/kimi-k3.1-pro.json --load-format dummy --tp-slice 8 --num-layers 10 --project-layers 93 --backend cuda --input-lens 8192 --contexts 8192 --steps 64"
for b in $(echo "${TRACE_KL:-}" | tr ',' ' '); do trace kl $b "$KLB"; done
for b in $(echo "${TRACE_K31:-}" | tr ',' ' '); do trace k31 $b "$K31B"; done
# TRACE_KL_V / TRACE_K31_V: "name:ENV=v,ENV=v ..." each variant's B = 1 timeline
for v in ${TRACE_KL_V:-}; do trace kl_${v%%:*} 1 "$KLB" "${v#*:}"; done
for v in ${TRACE_K31_V:-}; do trace k31_${v%%:*} 1 "$K31B" "${v#*:}"; done
pre() { grep -A3 '^prefill' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "%s: %s s (%s MFU)  ", $1, $2, $6}'; echo; }
for r in $(seq 1 "${PF_ROUNDS:-2}"); do
  step "KL48 prefill 8K round $r"
  timeout 60 $P/bin/lunar bench configs/kimi-linear-48b-a3b.json --load-format dummy --backend cuda \
    --max-len 9000 --input-lens 8192 --batch-sizes 1 --contexts 1024 --steps 4 > $OUT/pf_$r.log 2>&1
  echo "rc=$? $(pre $OUT/pf_$r.log)" >> $T
done
step done
(cd "$OUT" && tar czf ab.tgz --exclude=ab.txt --exclude=s -- * 2>/dev/null; find . -maxdepth 1 -type f ! -name ab.tgz ! -name ab.txt -delete)
[ -f $OUT/s/session.txt ] && cat $OUT/s/session.txt
cat $T
