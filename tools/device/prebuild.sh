#!/usr/bin/env bash
# Builds lunar and its tests here (sm_90a) and copies them, stripped of debug info, with the shared
# libraries the device image lacks (jansson, pcre2, libmicrohttpd and their dependencies; not
# glibc, not the CUDA libraries, not NCCL) into DIR/bin and DIR/lib, for check.sh's PREBUILT and
# session.sh, and the kernel timeline's CUPTI injection library with the CUPTI it links (DIR/lib:
# tools/device/kernel_trace.c, read by timeline.py). Also builds build-device/ (check.sh's op tests) for SKIP_BUILD=1.
#   tools/device/prebuild.sh DIR
set -eu
cd "$(dirname "$0")/../.."
D=${1:?usage: prebuild.sh DIR}
make -j"$(nproc)" build/lunar build/lunar_tests > /dev/null
BUILD_ONLY=1 OUT=/tmp/prebuild-check tools/device/check.sh ops > /tmp/prebuild-check.log 2>&1 ||
  { tail -20 /tmp/prebuild-check.log; exit 1; }
rm -rf "$D"
mkdir -p "$D/bin" "$D/lib"
for b in lunar lunar_tests; do strip -g -o "$D/bin/$b" "build/$b"; done
ldd build/lunar build/lunar_tests | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so|/cuda|nccl' |
  while read -r l; do cp -L "$l" "$D/lib/"; done
# the kernel timeline's CUPTI injection library (tools/device/kernel_trace.c) and the toolkit's CUPTI it links
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
if [ -f "$CUDA_HOME/include/cupti.h" ]; then
  gcc -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -I"$CUDA_HOME/include" -o "$D/lib/libkernel_trace.so" \
    tools/device/kernel_trace.c -L"$CUDA_HOME/lib" -L"$CUDA_HOME/lib64" -lcupti -lpthread
  ldd "$D/lib/libkernel_trace.so" | awk '/libcupti/ {print $3}' | xargs -r -I{} cp -L {} "$D/lib/"
fi
du -sh "$D" build-device
