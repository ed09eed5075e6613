#!/usr/bin/env bash
# For session 11's first call (one H200), what session 10 changed after its last device call and could not time:
# the BF16 MoE down decode kernel with the opt bits compiled out (the default since 91ff6ef's parent; its PTX is
# d0b593b's kernel's), against the run-time-bits kernel (LUNAR_MOE_DEC_OPT=7) at B = 1 / 32 / 64 and against
# d0b593b's build at B = 1 and 32 (binmulti.sh); then issue 9's tables (the K3.1 slice projected to 93 layers after
# the AttnRes fix) and the model-level tests.
#   P=<prebuilt dir, with bin/lunar_d0b593b: d0b593b's lunar built here> tools/device/session11_first.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
export P OUT
SKIP_CHECK=${SKIP_CHECK:-1} TESTS="${TESTS:-cuda_moe_ cuda_forward cuda_attnres}" AB="LUNAR_MOE_DEC_OPT=7" \
  AB_BATCH=1,32,64 bash tools/device/session7_final.sh > /dev/null 2>&1
SUMMARY=s11.txt . tools/device/env.sh
if [ -x "$P/bin/lunar_d0b593b" ]; then
  for b in 1 32; do
    step "binmulti: d0b593b vs main, Kimi-Linear B=$b"
    BINS="$P/bin/lunar_d0b593b $P/bin/lunar" BATCH=$b ROUNDS=3 timeout 150 bash tools/device/binmulti.sh > /dev/null 2>&1
    grep -E '^(round|mean)' $OUT/binmulti.txt >> $T; mv $OUT/binmulti.txt $OUT/binmulti_$b.txt
  done
fi
step done
rm -f $OUT/bm.log
cat $OUT/final.txt $T
