#!/usr/bin/env bash
# Installs kda.cpp's build and test dependencies from Debian packages (idempotent).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config clang-format
  libopenblas-openmp-dev   # fp32 GEMM; its OpenMP build stays single-threaded inside our loops
  nlohmann-json3-dev       # safetensors headers, configs, fixtures metadata
  libgtest-dev             # unit and property tests
)
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
