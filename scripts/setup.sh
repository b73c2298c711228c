#!/usr/bin/env bash
# Installs kda.cpp's build and test dependencies from Debian packages (idempotent).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config clang-format
  libopenblas-openmp-dev   # fp32 GEMM; its OpenMP build stays single-threaded inside our loops
  nlohmann-json3-dev       # safetensors headers, configs, fixtures metadata
  libgtest-dev             # unit and property tests
  libpcre2-dev             # tokenizer pre-tokenizer regexes
)
# Node + npm for the tokenizer reference data (scripts/tokenizer_testdata.sh); a node that is
# already there (e.g. NodeSource, which bundles npm) is kept.
if ! command -v node >/dev/null 2>&1; then
  packages+=(nodejs npm)
elif ! command -v npm >/dev/null 2>&1; then
  packages+=(npm)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
