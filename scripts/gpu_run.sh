#!/usr/bin/env bash
# One run on the GPU machine: configure (cmake --preset gpu, Ninja), build kda_gpu_check,
# run the correctness checks against the float64 CPU reference, benchmark our kernels, time
# fla on the same shapes (when gpu_carry/fla is present), and print the table last.
#
#   scripts/gpu_run.sh [--check-only | --bench-only]
#
# Logs and tables go to $OUT when set (the device tool's output folder), else out/gpu/.
# Exit status: non-zero if the build fails or any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
log_dir="${OUT:-out/gpu}"
mkdir -p "$log_dir"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv,noheader 2>/dev/null || echo "(nvidia-smi unavailable)"
date -u +"%Y-%m-%d %H:%M UTC"

echo "== configure + build (build-gpu, sm_90a)"
start=$(date +%s)
if ! cmake --preset gpu >"$log_dir/configure.log" 2>&1; then
  tail -40 "$log_dir/configure.log"
  exit 1
fi
if ! cmake --build build-gpu --target kda_gpu_check -j "$(nproc)" >"$log_dir/build.log" 2>&1; then
  grep -E "error|warning" -A3 "$log_dir/build.log" | head -60
  exit 1
fi
echo "built in $(($(date +%s) - start)) s"

args=(--out "$log_dir/ours.tsv")
case "$mode" in
  --check-only) args+=(--check) ;;
  --bench-only) args+=(--bench) ;;
  *) args+=(--check --bench) ;;
esac
echo "== kda_gpu_check ${args[*]}"
timeout 420 ./build-gpu/bin/kda_gpu_check "${args[@]}" 2>&1 | tee "$log_dir/check_bench.log"
status=${PIPESTATUS[0]}
[ "$mode" = "--check-only" ] && exit "$status"

echo "== fla (same shapes, same run)"
if [ -d gpu_carry/fla ]; then
  export PYTHONPATH="$PWD/gpu_carry${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_carry/fla not found: fla will not be timed (copy fla/ from its repository there)"
fi
PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu/fla_bench.py --ours "$log_dir/ours.tsv" \
  --out "$log_dir/table.md" 2>&1 | grep -v "Warning\|warn(" | tail -40
exit "$status"
