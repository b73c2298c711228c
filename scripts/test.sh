#!/usr/bin/env bash
# The whole test suite: the Release build's tests, then the file-format robustness tests again
# under AddressSanitizer + UBSan. Builds what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${KDA_JOBS:-$(nproc)}
cmake --preset release >/dev/null
cmake --build --preset release -j "$jobs"
bash scripts/tokenizer_testdata.sh  # reference encodings the tokenizer tests read (npm)
ctest --preset release -j "$jobs"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs" --target kda_tests
ctest --preset asan -j "$jobs"
