#!/usr/bin/env bash
# Installs the Debian packages lunar builds and tests with, when any is missing.
# Used by `make deps` (and so by `make run` / `make check`) and by .ci/run.
set -euo pipefail

packages=(build-essential pkg-config libjansson-dev libpcre2-dev zlib1g-dev libmicrohttpd-dev clang libclang-rt-14-dev)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing Debian packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
