#!/usr/bin/env bash
# Issue 8, session 10, call 1 (branch s10-mx4tp8, binaries of 949238e; KSPLIT was removed in e59936c, so its variants now run the default): path 16 at K3.1's TP8 slice (gate/up K split across
# blocks, LUNAR_MOE_F16_KSPLIT; the down kernel's first ring fill before griddepcontrol.wait and the
# route's two loads together, LUNAR_MOE_F16_EARLY). In order, each step only while time is left:
# the MXFP4 op tests (new KSPLIT / EARLY cases), the decode bench at batch 1 (two rounds alternating
# over the variants), the K3 forward test under V, the K3.1 TP8 slice B = 1, 8 (off against V,
# alternating). V unset: the variant with the lowest TP8 sum over the bench rounds.
#   P=.xfer-NAME OUT=/tmp/o [V="LUNAR_MOE_F16_KSPLIT=2 LUNAR_MOE_F16_EARLY=3"] tools/device/mx4tp8.sh
set -u
P=${P:?P = the prebuilt directory}
OUT=${OUT:-/tmp/o}
V=${V:-}
VARS=${VARS:-"base K2 K3 K4 E1 E3 K2E3"}
ROUNDS=${ROUNDS:-2}
MODEL_ROUNDS=${MODEL_ROUNDS:-1}
TESTS=${TESTS:-1}
SUMMARY=mx4tp8.txt . tools/device/env.sh
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
setv() {  # a variant's switches: K<n> = KSPLIT=n, E<b> = EARLY=b, Ka = KSPLIT=auto, T0 = TILES=0
  unset LUNAR_MOE_F16_KSPLIT LUNAR_MOE_F16_EARLY LUNAR_MOE_F16_TILES
  case $1 in *T0*) export LUNAR_MOE_F16_TILES=0;; esac
  case $1 in *K[234]*) export LUNAR_MOE_F16_KSPLIT=$(echo $1 | sed 's/.*K\([234]\).*/\1/');; esac
  case $1 in *Ka*) export LUNAR_MOE_F16_KSPLIT=auto;; esac
  case $1 in *E[123]*) export LUNAR_MOE_F16_EARLY=$(echo $1 | sed 's/.*E\([123]\).*/\1/');; esac
}
if [ "$TESTS" = 1 ]; then
  step "op tests: cuda_moe_experts_mxfp4 (switches unset; the new case sets them)"
  OMP_NUM_THREADS=16 timeout 60 $P/bin/lunar_tests cuda_moe_experts_mxfp4 > $OUT/t_moe.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |CHECK|KSPLIT=[234a][a-z]* EARLY=0 ' $OUT/t_moe.log | cut -c1-200 | tail -24 >> $T
fi
for r in $(seq 1 $ROUNDS); do for x in $VARS; do
  left 100 || break
  step "decode1 bench $x round $r"
  setv $x
  LUNAR_MOE_BENCH=decode1 timeout 15 $P/bin/lunar_tests cuda_moe_bench > $OUT/bench_${x}_$r.log 2>&1
  echo "rc=$?" >> $T
  grep -E '^\| K3|Measured' $OUT/bench_${x}_$r.log | cut -d'|' -f2,3,6,7,16,17,19 >> $T
done; done
unset LUNAR_MOE_F16_KSPLIT LUNAR_MOE_F16_EARLY LUNAR_MOE_F16_TILES
venv() {  # a variant's switches as VAR=value words
  local o=""
  case $1 in *T0*) o="$o LUNAR_MOE_F16_TILES=0";; esac
  case $1 in *K[234]*) o="$o LUNAR_MOE_F16_KSPLIT=$(echo $1 | sed 's/.*K\([234]\).*/\1/')";; esac
  case $1 in *Ka*) o="$o LUNAR_MOE_F16_KSPLIT=auto";; esac
  case $1 in *E[123]*) o="$o LUNAR_MOE_F16_EARLY=$(echo $1 | sed 's/.*E\([123]\).*/\1/')";; esac
  echo $o
}
step "TP8 f16 us summed over the rounds"
best=""; bs=1e9
for x in $VARS; do
  sm=$(cat $OUT/bench_${x}_*.log 2> /dev/null | grep '^| K3.1 TP8' | awk -F'|' '{s += $16; n++} END {if (n) printf "%.2f", s / n; else print 1e9}')
  echo "$x mean $sm" >> $T
  if [ $x != base ] && awk "BEGIN {exit !($sm < $bs)}"; then best=$x; bs=$sm; fi
done
[ -z "$V" ] && V=$(venv ${best:-E3})
echo "V = $V" >> $T
if [ "$TESTS" = 1 ] && [ -n "$V" ] && left 110; then
  step "cuda_forward_k3 ($V)"
  env $V OMP_NUM_THREADS=16 timeout 15 $P/bin/lunar_tests cuda_forward_k3 > $OUT/t_fwd.log 2>&1
  echo "rc=$?" >> $T
  grep -E 'FAILED|passed, |steps differ|CHECK' $OUT/t_fwd.log | cut -c1-200 | tail -4 >> $T
fi
tpot() { grep -A8 '^decode ' "$1" | awk '$1 ~ /^[0-9]+$/ {printf "B%s/%s %s ms  ", $1, $2, $3}'; echo; }
K3="configs/kimi-k3.1-pro.json --tp-slice 8 --num-layers 10 --project-layers 93"
for r in $(seq 1 $MODEL_ROUNDS); do for x in off on; do
  left 125 || break
  step "K3.1 slice $x ($V) round $r"
  if [ $x = on ]; then pre="env $V"; else pre=""; fi
  $pre timeout 16 $P/bin/lunar bench $K3 --load-format dummy --backend cuda --input-lens 8192 \
    --batch-sizes 1,8 --contexts 8192 > $OUT/k3_${x}_$r.log 2>&1
  echo "rc=$? $(tpot $OUT/k3_${x}_$r.log)" >> $T
done; done
step done
(cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=mx4tp8.txt -- * && rm -f t_* k3_* bench_*)
cat $T
