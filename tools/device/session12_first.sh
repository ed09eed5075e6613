#!/usr/bin/env bash
# For session 12's first call (one H200): the two refactors session 11 made after its last call (st::wg_max in
# cuda_mla_wgmma.cu, PTX-identical; lt_algo / lt_release in cuda_gemm.cu, host code) under their tests, then the
# SASS-level stall samples of the K3.1 slice's latency-bound decode kernels (tools/device/ncu_src.sh: route-one,
# 17 us for 16 rounds in one warp; the AttnRes mix, 7 us for 280 KB in one block; the DSA top-k, 22 us), then
# issue 9's tables (session11_final.sh with no A/B).
#   P=<prebuilt dir: bin/lunar, bin/lunar_tests, lib/> OUT=<dir> tools/device/session12_first.sh
set -u
P=${P:?prebuilt dir}
OUT=${OUT:-/tmp/o}
export P OUT
SPECS="cuda_moe_route_one|router_warp_kernel<[^,]*,.28|0;cuda_attnres_fused|attnres_kernel<32>|1;cuda_dsa_indexer_vs_cpu|topk_kernel|0" \
  timeout 330 bash tools/device/ncu_src.sh > /dev/null 2>&1
TESTS="cuda_mla cuda_matmul cuda_forward" ROUNDS=0 timeout 200 bash tools/device/session11_final.sh > /dev/null 2>&1
cat "$OUT/ncu_src.txt" "$OUT/final.txt"
