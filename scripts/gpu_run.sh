#!/usr/bin/env bash
# One run on the GPU machine: configure (cmake --preset gpu, Ninja), build kda_gpu_check and
# kda_gpu_model, run the model path (kda_gpu_model: layer kernels, attention, MoE, the fixture
# models through CUDA, then prefill / decode of a Kimi-Linear-shaped model), run the delta-rule
# kernels' checks against the CPU references, benchmark them, run compute-sanitizer (memcheck,
# racecheck) on one small case, time fla on the same shapes (when gpu_carry/fla is present) and
# FlashKDA (when flashkda_carry/flashkda is: built in the background), and print the table last. Fixture models come from gpu_carry/shared/models (a copy of
# ../shared/fixtures/models; only gpt2_tiny keeps grads/, for the gpt2_train suite; ../shared
# does not travel). How to fill gpu_carry/: docs/GPU_NOTES.md, "Preparing gpu_carry".
#
#   scripts/gpu_run.sh [--check-only | --bench-only | --no-fla | --model | --train | --lab |
#                       --lab-rows | --rows | --decode | --sanitize | --flashkda | --profile]
#
# --flashkda: the KDA forward rows beside fla's and FlashKDA's only (a ~5-minute call);
#           KDA_PEER_ROWS=chunk adds the Gated DeltaNet rows, KDA_PEER_SECONDS the time budget.
# --no-fla: everything but timing fla (a quicker call).
# --model:  the model path (checks + benchmarks) and the delta-rule kernels' checks only; then
#           the kda binary on the GPU (verify, run, and bench decode --device cuda).
# --lab:    the kernel lab's checks in one call (~7 minutes): kda_gpu_check --check, the
#           same with KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 (the wgmma state walks, forward and
#           reverse, forced on every grid; the default takes them on full grids only); then the
#           timings on an idle GPU: the B = 16 decode rows, the chunked forward rows twice
#           (KDA_LAB_KNOBS: ';'-separated knob sets), the KDA forward + backward rows with the
#           defaults and with KDA_BWD_EXACT_ALL=1 (every chunk of raw g through chunk_bwd_local's
#           EXACT instance, as before session 19); then, with KDA_LAB_RECALL="DIR options", the
#           recall grid started in DIR (scripts/recall_grid.sh start DIR options: it trains on
#           while the checks below run and after the call); then the decode checks with
#           KDA_DECODE_OVERLAP=1 KDA_DECODE_PREFETCH=1, the model checks (kda_gpu_model --check
#           model) and racecheck --small. With KDA_LAB_TRAIN=1 also
# --lab-rows: the experiments' timings only (the next call, ~3 minutes): the chunked rows with
#           the wgmma walk forced, without the GDN raw path, with GDN's M from chunk_prepare
#           (KDA_GDN_STATE_M=0), the state walk alone on both walks (KDA_LAB_ROW_KNOBS overrides),
#           the KDA forward + backward rows on the mma.sync and the wgmma walks, and the decode
#           rows without PDL, with it, and with the early state fetch.
# --train:  training on the GPU only: one build (kda, kda_gpu_model, kda_gpu_train; needs
#           gpu_carry/pcre2), the training kernels' checks (attention, attention_bwd,
#           lineage_ops, linear_attn, train, gpt2_train, gemm), the lineage GPU trainer against the
#           CPU one and its throughput; then, when KDA_RECALL is set,
#           `kda bench recall --device cuda $KDA_RECALL`.
#           KDA_SKIP_KERNELS / KDA_SKIP_TRAIN_CHECK skip the kernel suites / the trainer checks;
#           KDA_SUITES="train ..." runs those kernel suites only;
#           KDA_TRAIN_BENCH=--check skips the trainer's throughput; KDA_PROFILE=1 times a 125M
#           step by stage (kda_gpu_train --profile); KDA_NSYS profiles one step with nsys.
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

script_start=$(date +%s)

# build-gpu-app (the kda binary's configuration, with the CUDA kernels; needs gpu_carry/pcre2):
# configure and build the named targets (and KDA_EXTRA_TARGETS: e.g. kda, for a recall grid
# started after the timings), or stop the script with the errors
build_app() {
  echo "== configure + build (build-gpu-app: $*; sm_90a)"
  export PKG_CONFIG_PATH="$PWD/gpu_carry/pcre2/lib/pkgconfig" LD_LIBRARY_PATH="$PWD/gpu_carry/pcre2/lib"
  local start
  start=$(date +%s)
  if ! { cmake -S . -B build-gpu-app -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DKDA_TESTS=OFF >"$log_dir/configure_app.log" 2>&1 &&
    cmake --build build-gpu-app --target "$@" ${KDA_EXTRA_TARGETS:-} -j "$(nproc)" >"$log_dir/build_app.log" 2>&1; }; then
    grep -E "error" -A3 "$log_dir/configure_app.log" "$log_dir/build_app.log" | head -40
    exit 1
  fi
  rm -f "$log_dir/configure_app.log" "$log_dir/build_app.log"
  echo "built in $(($(date +%s) - start)) s"
}

# fla, and FlashKDA when its background build (below) succeeded, on the shapes of ours.tsv, in
# what is left of $1 seconds since the script started (fla prints the table with what it
# measured if that cuts it short); further arguments go to fla_bench.py
time_peers() {
  local total=$1
  shift
  local args=("$@") left
  if [ -d gpu_carry/fla ]; then
    export PYTHONPATH="$PWD/gpu_carry${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_carry/fla not found: fla will not be timed (copy fla/ from its repository there)"
  fi
  if [ -n "$flashkda_pid" ]; then
    if wait "$flashkda_pid"; then
      export PYTHONPATH="$PWD/$flashkda_dir${PYTHONPATH:+:$PYTHONPATH}"
      args+=(--flashkda)
    else
      echo "FlashKDA build failed:"
      grep -iE "error" "$log_dir/flashkda_build.log" | grep -v pathspec | head -10
    fi
  fi
  left=$((total - ($(date +%s) - script_start)))
  [ "$left" -lt 60 ] && left=60
  PYTHONUNBUFFERED=1 timeout -k 15 "$left" python3 bench/gpu/fla_bench.py --ours "$log_dir/ours.tsv" \
    --out "$log_dir/table.md" --budget $((left > 90 ? left - 60 : 30)) "${args[@]}" 2>&1 |
    tee "$log_dir/fla.log" | grep -E "^(fla|FlashKDA|\|)" | grep -v "^| decode_.*_\(tile\|head\) "
  # (only fla's result lines and the table: a Triton failure's reproducer dump, thousands of
  # lines, pushed session 22's results out of the call's output tail; the whole log is in fla.log)
}

# kda_gpu_check --bench rows once per ';'-separated knob set ($3): KDA_BENCH_ONLY=$1, the lines
# matching $2, under the heading "== $4 rows with: knobs"
bench_rows() {
  local knob_sets knobs
  IFS=';' read -r -a knob_sets <<<"$3"
  [ ${#knob_sets[@]} -eq 0 ] && knob_sets=("")  # no knobs: the defaults once
  for knobs in "${knob_sets[@]}"; do
    echo "== $4 rows with: ${knobs:-(defaults)}"
    # shellcheck disable=SC2086
    env $knobs KDA_BENCH_ONLY="$1" timeout 200 ./build-gpu-app/bin/kda_gpu_check --bench 2>&1 |
      grep -E "$2"
  done
}
# the chunked forward rows
chunk_rows() { bench_rows chunk "chunk_fwd (kda|kda-layer|gdn) " "$1" "chunked forward"; }
# the KDA forward + backward rows, and the softplus-gate layer rows
fwdbwd_rows() {
  bench_rows kda "BENCH chunk_fwd\+bwd|BENCH chunk kda-layer softplus" "$1" "KDA forward + backward"
}

if [ "$mode" = "--lab" ]; then
  build_app kda kda_gpu_check kda_gpu_model kda_gpu_train  # (kda: recall_grid.sh can start next)
  echo "== kda_gpu_check --check"
  timeout 240 ./build-gpu-app/bin/kda_gpu_check --check >"$log_dir/lab_check.log" 2>&1
  status=$?
  grep -E "FAIL|NOTE" "$log_dir/lab_check.log" | head -20
  echo "checks: exit $status, $(grep -c "^CHECK.*PASS" "$log_dir/lab_check.log") pass"
  # the wgmma state walks (chunk_state_wgmma.cu, chunk_state_bwd_wgmma.cu): every check again
  # with them in place of the mma.sync walks (forward, backward and its recompute,
  # trainer); forward checks failing point at the forward walk, backward ones with the
  # forward's passing at the reverse walk
  echo "== kda_gpu_check --check with KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1"
  KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 timeout 240 ./build-gpu-app/bin/kda_gpu_check --check \
    >"$log_dir/lab_check_wgmma.log" 2>&1 || status=1
  grep -E "FAIL|NOTE" "$log_dir/lab_check_wgmma.log" | head -20
  echo "wgmma checks: $(grep -c "^CHECK.*PASS" "$log_dir/lab_check_wgmma.log") pass"
  # the timings, on an idle GPU: decode B = 16, the chunked forward rows, the KDA forward +
  # backward rows with chunk_bwd_local's wide-chunk split (default) and without it
  timeout 120 ./build-gpu-app/bin/kda_gpu_check --decode --bench 2>&1 |
    grep -E "BENCH decode (kda|gdn) B=16 (auto|graph|same)"
  chunk_rows "${KDA_LAB_KNOBS:-;;}"
  fwdbwd_rows ";KDA_BWD_EXACT_ALL=1"
  if [ -n "${KDA_LAB_RECALL:-}" ]; then
    if [ "$status" -eq 0 ]; then
      # shellcheck disable=SC2086
      bash scripts/recall_grid.sh start $KDA_LAB_RECALL
    else
      echo "(recall not started: a check failed)"
    fi
  fi
  # the model path (kimi-mini's softplus-gate bf16 prefill on the chunked kernel among it)
  echo "== kda_gpu_model --check model"
  timeout 200 ./build-gpu-app/bin/kda_gpu_model --check --shared gpu_carry/shared model \
    >"$log_dir/lab_model.log" 2>&1 || status=1
  grep -E "FAIL" "$log_dir/lab_model.log" | head -20
  echo "model checks: $(grep -c "^CHECK.*PASS" "$log_dir/lab_model.log") pass"
  # decode: the state fetched before the programmatic wait
  # (KDA_DECODE_PREFETCH, with KDA_DECODE_OVERLAP): the decode checks, the back-to-back chain
  # among them
  echo "== kda_gpu_check --decode --check with KDA_DECODE_OVERLAP=1 KDA_DECODE_PREFETCH=1"
  KDA_DECODE_OVERLAP=1 KDA_DECODE_PREFETCH=1 timeout 120 ./build-gpu-app/bin/kda_gpu_check \
    --decode --check >"$log_dir/lab_decode_check.log" 2>&1 || status=1
  grep -E "FAIL" "$log_dir/lab_decode_check.log" | head -20
  echo "decode checks: $(grep -c "^CHECK.*PASS" "$log_dir/lab_decode_check.log") pass"
  # racecheck (the wgmma walks forced, so that they are covered too)
  echo "== racecheck --small"
  KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 timeout 120 compute-sanitizer \
    --tool racecheck --error-exitcode 3 ./build-gpu-app/bin/kda_gpu_check --small \
    >"$log_dir/lab_racecheck.log" 2>&1
  echo "racecheck: exit $? ($(grep -c "^CHECK.*PASS" "$log_dir/lab_racecheck.log") checks pass)"
  grep -E "RACECHECK SUMMARY|Race reported" "$log_dir/lab_racecheck.log" | head -4
  if [ "${KDA_LAB_TRAIN:-0}" != "1" ]; then
    echo "(the trainer's checks and the recall profile: KDA_LAB_TRAIN=1)"
    exit "$status"
  fi
  echo "== kda_gpu_train --check"
  timeout 240 ./build-gpu-app/bin/kda_gpu_train --check >"$log_dir/lab_train_check.log" 2>&1 ||
    status=1
  grep -E "FAIL" "$log_dir/lab_train_check.log" | head -20
  tail -1 "$log_dir/lab_train_check.log"
  echo "== KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 kda_gpu_train --check"
  KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 timeout 240 ./build-gpu-app/bin/kda_gpu_train --check \
    >"$log_dir/lab_train_check_wgmma.log" 2>&1 || status=1
  grep -E "FAIL" "$log_dir/lab_train_check_wgmma.log" | head -20
  tail -1 "$log_dir/lab_train_check_wgmma.log"
  echo "== kda_gpu_train --profile-recall"
  timeout 150 ./build-gpu-app/bin/kda_gpu_train --profile-recall 2>&1 | grep -E "PROFILE|BENCH"
  exit "$status"
fi

# --profile: Nsight Compute on chunk_prepare (Gated DeltaNet, and the KDA layer, at 8 x 2048) and
# on the Gated DeltaNet state walk
# with SASS-level metrics (build-gpu-prof, -lineinfo): each instruction's stall samples and
# shared wavefronts to $OUT (ncu_<kind>_sass.csv), summed by stall reason and opcode on stdout
# (bench/gpu/ncu_hot_lines.py) with a few lines of the details page; then with
# every delta-rule check (where one fails, again with each of KDA_LAB_KNOBS, ';'-separated knob
# sets); then the KDA forward rows (stages timed alone) and the softplus-gate layer rows with the
# defaults and each knob set, and the Gated DeltaNet rows.
if [ "$mode" = "--profile" ]; then
  echo "== configure + build (build-gpu-prof: kda_gpu_check, -lineinfo)"
  start=$(date +%s)
  cmake -S . -B build-gpu-prof -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_CUDA_FLAGS=-lineinfo -DKDA_TESTS=OFF -DKDA_APPS=OFF >"$log_dir/configure_prof.log" 2>&1 &&
    cmake --build build-gpu-prof --target kda_gpu_check -j "$(nproc)" >"$log_dir/build_prof.log" 2>&1 ||
    { grep -E "error" -A3 "$log_dir/configure_prof.log" "$log_dir/build_prof.log" | head -40; exit 1; }
  rm -f "$log_dir/configure_prof.log" "$log_dir/build_prof.log"
  echo "built in $(($(date +%s) - start)) s"
  prof_bin=./build-gpu-prof/bin/kda_gpu_check
  # KDA_PROFILE_KINDS picks the kernels (default: gdn layer gdn_state)
  for kind in ${KDA_PROFILE_KINDS:-gdn layer gdn_state}; do
    # the first matching launch is the 8 x 2048 shape (KDA rows first, GDN after them)
    case $kind in
      gdn) only=chunk re='prepare_kernel<[^,]*1, [^,]*128, [^,]*128' ;;
      layer) only=kda re='prepare_kernel<[^,]*2, [^,]*128, [^,]*128, [^,]*(true|1)' ;;
      kda_state) only=kda re='state_wgmma_kernel<[^,]*128, [^,]*128, [^,]*(false|0), [^,]*(false|0)' ;;
      *) only=chunk re='state_wgmma_kernel<[^,]*128, [^,]*128, [^,]*(true|1), [^,]*(true|1)' ;;
    esac
    echo "== ncu $kind (8 x 2048)"
    KDA_BENCH_ONLY=$only timeout 300 ncu --kernel-name-base demangled --kernel-name "regex:$re" \
      --launch-count 1 --kill yes --set full --import-source yes -f -o "/tmp/prep_$kind" \
      "$prof_bin" --bench >"/tmp/ncu_$kind.log" 2>&1
    grep -E "^==(PROF|WARNING|ERROR)==" "/tmp/ncu_$kind.log" | head -5
    ncu -i "/tmp/prep_$kind.ncu-rep" --page details 2>&1 |
      grep -E "^ *(Duration|Memory Throughput|DRAM Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issue Slots Busy) " |
      sort -u | head -8
    ncu -i "/tmp/prep_$kind.ncu-rep" --page source --csv --print-source sass \
      >"$log_dir/ncu_${kind}_sass.csv" 2>&1
    python3 bench/gpu/ncu_hot_lines.py "$log_dir/ncu_${kind}_sass.csv" --top 8
    # the same samples by CUDA source line (read beside the code afterwards)
    ncu -i "/tmp/prep_$kind.ncu-rep" --page source --csv --print-source cuda \
      >"$log_dir/ncu_${kind}_cuda.csv" 2>&1
  done
  [ -n "${KDA_PROFILE_ONLY:-}" ] && exit 0  # the profiles alone
  # every delta-rule check with the defaults; where one fails, again with each of KDA_LAB_KNOBS
  # (';'-separated knob sets), to tell which change failed
  status=0
  IFS=';' read -r -a prof_knob_sets <<<"${KDA_LAB_KNOBS:-}"
  for knobs in "" "${prof_knob_sets[@]}"; do
    [ -n "$knobs" ] && [ "$status" -eq 0 ] && break
    echo "== kda_gpu_check --check with: ${knobs:-(defaults)}"
    # shellcheck disable=SC2086
    env $knobs timeout 240 "$prof_bin" --check >"$log_dir/prof_check.log" 2>&1 || status=1
    grep -E "FAIL" "$log_dir/prof_check.log" | head -12
    echo "checks: $(grep -c "^CHECK.*PASS" "$log_dir/prof_check.log") pass"
  done
  for knobs in "" "${prof_knob_sets[@]}"; do
    echo "== chunked forward rows with: ${knobs:-(defaults)}"
    # shellcheck disable=SC2086
    env $knobs KDA_BENCH_ONLY=kda timeout 150 "$prof_bin" --bench 2>&1 |
      grep -E "BENCH chunk_fwd (kda|kda-layer) |BENCH chunk kda-layer softplus"
  done
  echo "== Gated DeltaNet rows (defaults)"
  KDA_BENCH_ONLY=chunk timeout 150 "$prof_bin" --bench 2>&1 | grep -E "BENCH chunk_fwd gdn "
  exit "$status"
fi

# kda_gpu_check with the arguments after $2, under the knobs $1 (space-separated VAR=value), its
# log in $log_dir/$2: prints the failures and how many checks passed; non-zero when one failed
checks_with() {
  local knobs=$1 log=$2 rc
  shift 2
  # shellcheck disable=SC2086
  env $knobs timeout 240 ./build-gpu-app/bin/kda_gpu_check "$@" >"$log_dir/$log" 2>&1
  rc=$?
  grep -E "FAIL" "$log_dir/$log" | head -20
  echo "checks: $(grep -c "^CHECK.*PASS" "$log_dir/$log") pass"
  return $rc
}

# compute-sanitizer --tool $1 on the small case under the knobs $2, its log in $log_dir/$3; the
# program and its arguments after (default: kda_gpu_check --small)
sanitize_small() {
  local tool=$1 knobs=$2 log=$3 rc
  shift 3
  [ $# -gt 0 ] || set -- ./build-gpu-app/bin/kda_gpu_check --small
  # shellcheck disable=SC2086
  env $knobs timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 3 \
    "$@" >"$log_dir/$log" 2>&1
  rc=$?
  echo "$tool: ($(grep -c "^CHECK.*PASS" "$log_dir/$log") checks pass)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race reported|Invalid" "$log_dir/$log" | head -4
  return $rc
}

racecheck_small() { sanitize_small racecheck "$1" "$2"; }

# --sanitize: memcheck, then racecheck, on the small case (~3 minutes; KDA_SANITIZE_KNOBS: a knob
# set for both), e.g. the first call after a kernel's path changed without a sanitizer run; then
# the same on linear attention's walks (kda_gpu_model --small linear_attn).
if [ "$mode" = "--sanitize" ]; then
  build_app kda_gpu_check kda_gpu_model
  status=0
  sanitize_small memcheck "${KDA_SANITIZE_KNOBS:-}" small_memcheck.log || status=1
  sanitize_small racecheck "${KDA_SANITIZE_KNOBS:-}" small_racecheck.log || status=1
  linear=(./build-gpu-app/bin/kda_gpu_model --check --small linear_attn)
  sanitize_small memcheck "" linear_memcheck.log "${linear[@]}" || status=1
  sanitize_small racecheck "" linear_racecheck.log "${linear[@]}" || status=1
  exit "$status"
fi

# --rows: a kernel change's first run (~4 minutes): the delta-rule checks with the defaults and
# with each KDA_ROWS_CHECK_KNOBS set (';'-separated), the chunked forward rows once per
# KDA_LAB_KNOBS set (an empty set is the defaults), the forward + backward rows (once per
# KDA_FWDBWD_KNOBS set), then racecheck on the small case (last: a call cut short loses it first).
if [ "$mode" = "--rows" ]; then
  build_app kda_gpu_check
  status=0
  IFS=';' read -r -a check_knob_sets <<<";${KDA_ROWS_CHECK_KNOBS:-}"
  for knobs in "${check_knob_sets[@]}"; do
    echo "== kda_gpu_check --check with: ${knobs:-(defaults)}"
    checks_with "$knobs" rows_check.log --check || status=1
  done
  chunk_rows "${KDA_LAB_KNOBS:-}"
  fwdbwd_rows "${KDA_FWDBWD_KNOBS:-}"
  echo "== racecheck --small"
  racecheck_small "" rows_racecheck.log || status=1
  exit "$status"
fi

# --decode: a decode kernel change's run (~2 minutes): for the defaults and each KDA_DECODE_KNOBS
# set (';'-separated), the decode checks (with programmatic launch and the early state fetch,
# as the models run it) and the decode rows at B = 16, 64, 128; then racecheck on the small case
# with KDA_DECODE_RACE_KNOBS when set.
if [ "$mode" = "--decode" ]; then
  build_app kda_gpu_check
  status=0
  IFS=';' read -r -a decode_knob_sets <<<";${KDA_DECODE_KNOBS:-}"
  for knobs in "${decode_knob_sets[@]}"; do
    echo "== decode checks and rows with: ${knobs:-(defaults)}"
    checks_with "$knobs KDA_DECODE_OVERLAP=1 KDA_DECODE_PREFETCH=1" decode_check.log \
      --decode --check || status=1
    # shellcheck disable=SC2086
    env $knobs timeout 120 ./build-gpu-app/bin/kda_gpu_check --decode --bench 2>&1 |
      grep -E "BENCH decode (kda|gdn) B=(16|64|128) (auto|graph|same)"
  done
  if [ -n "${KDA_DECODE_RACE_KNOBS:-}" ]; then
    echo "== racecheck --small with: $KDA_DECODE_RACE_KNOBS"
    racecheck_small "$KDA_DECODE_RACE_KNOBS" decode_racecheck.log || status=1
  fi
  exit "$status"
fi

if [ "$mode" = "--lab-rows" ]; then
  build_app kda_gpu_check
  chunk_rows "${KDA_LAB_ROW_KNOBS:-KDA_STATE_WGMMA=1;KDA_STATE_WGMMA=1 KDA_GDN_RAW=0;KDA_STATE_WGMMA=1 KDA_GDN_STATE_M=0;KDA_CHUNK_STAGES=state;KDA_CHUNK_STAGES=state KDA_STATE_WGMMA=1}"
  fwdbwd_rows ";KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1"
  for knobs in "" "KDA_DECODE_OVERLAP=1" "KDA_DECODE_OVERLAP=1 KDA_DECODE_PREFETCH=1"; do
    echo "== decode rows with: ${knobs:-(defaults)}"
    # shellcheck disable=SC2086
    env $knobs timeout 120 ./build-gpu-app/bin/kda_gpu_check --decode --bench 2>&1 |
      grep -E "BENCH decode (kda|gdn) B=(16|128) (auto|graph|same)|BENCH decode kda B=16 tokens"
  done
  exit 0
fi

if [ "$mode" = "--train" ]; then
  build_app kda kda_gpu_model kda_gpu_train
  status=0
  touch "$log_dir/train_kernels.log" "$log_dir/lineage_train.log"
  if [ -z "${KDA_SKIP_KERNELS:-}" ]; then
    echo "== kda_gpu_model: the training kernels"
    # shellcheck disable=SC2086
    timeout 240 ./build-gpu-app/bin/kda_gpu_model --check --bench --shared gpu_carry/shared \
      ${KDA_SUITES:-attention attention_bwd lineage_ops linear_attn train gpt2_train gemm} 2>&1 |
      tee "$log_dir/train_kernels.log" | grep -v "^CHECK.*PASS"
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
    echo "kernels: $(grep -c "^CHECK.*PASS" "$log_dir/train_kernels.log") checks pass"
    if [[ " ${KDA_SUITES:-attention} " == *" attention"* ]]; then
      # The 32-row tensor-core kernels run only on large grids (attention_wide_rows): check them
      # on every check shape too, and time the 16-row ones beside them.
      echo "== attention, attention_bwd with 32 query rows a warp everywhere (KDA_ATTENTION_ROWS=32)"
      KDA_ATTENTION_ROWS=32 timeout 120 ./build-gpu-app/bin/kda_gpu_model --check \
        --shared gpu_carry/shared attention attention_bwd 2>&1 |
        tee "$log_dir/attention_rows32.log" | grep -v "^CHECK.*PASS"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      echo "rows 32: $(grep -c "^CHECK.*PASS" "$log_dir/attention_rows32.log") checks pass"
      echo "== attention_bwd timings with 16 query rows a warp everywhere (KDA_ATTENTION_ROWS=16)"
      KDA_ATTENTION_ROWS=16 timeout 60 ./build-gpu-app/bin/kda_gpu_model --bench \
        --shared gpu_carry/shared attention_bwd 2>&1 | grep "^BENCH" | sed 's/^BENCH/BENCH rows16/' |
        tee "$log_dir/attention_rows16.log"
      # The wgmma kernels (head dims 128 / 128 on sm_90a) are the default: check and time the
      # mma.sync kernels they replace there too, and the 125M step with those.
      echo "== attention, attention_bwd with the mma.sync kernels only (KDA_ATTENTION_WGMMA=0)"
      KDA_ATTENTION_WGMMA=0 timeout 120 ./build-gpu-app/bin/kda_gpu_model --check --bench \
        --shared gpu_carry/shared attention attention_bwd 2>&1 |
        tee "$log_dir/attention_mma.log" | grep -v "^CHECK.*PASS" | sed 's/^BENCH/BENCH mma/'
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      echo "mma.sync: $(grep -c "^CHECK.*PASS" "$log_dir/attention_mma.log") checks pass"
      # the TMA forward (default: 2, with the intra-warpgroup overlap); 1 runs one product at a time
      echo "== attention with the TMA forward one product at a time (KDA_ATTENTION_TMA_FORWARD=1)"
      KDA_ATTENTION_TMA_FORWARD=1 timeout 120 ./build-gpu-app/bin/kda_gpu_model --check --bench \
        --shared gpu_carry/shared attention attention_bwd 2>&1 |
        tee "$log_dir/attention_tma_fwd1.log" | grep -v "^CHECK.*PASS" | grep -v decode |
        sed "s/^BENCH/BENCH tma-fwd1/"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      echo "TMA forward 1: $(grep -c "^CHECK.*PASS" "$log_dir/attention_tma_fwd1.log") checks pass"
      echo "== the 125M step with the mma.sync kernels (KDA_ATTENTION_WGMMA=0 kda_gpu_train --bench-2k)"
      KDA_ATTENTION_WGMMA=0 timeout 120 ./build-gpu-app/bin/kda_gpu_train --bench-2k 2>&1 |
        grep "^BENCH" | sed 's/^BENCH/BENCH mma/'
    fi
  fi
  if [ -z "${KDA_SKIP_TRAIN_CHECK:-}" ]; then
    echo "== kda_gpu_train --check ${KDA_TRAIN_BENCH:---bench}"
    # shellcheck disable=SC2086
    timeout 300 ./build-gpu-app/bin/kda_gpu_train --check ${KDA_TRAIN_BENCH:---bench} 2>&1 |
      tee "$log_dir/lineage_train.log" | grep -v "^CHECK.*PASS"
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
    # the trainers' lean path too (one shared chunk workspace, the backward recomputes)
    echo "== KDA_CHUNK_RECOMPUTE=1 kda_gpu_train --check"
    KDA_CHUNK_RECOMPUTE=1 timeout 200 ./build-gpu-app/bin/kda_gpu_train --check 2>&1 |
      tee "$log_dir/lineage_train_recompute.log" | grep -v "^CHECK.*PASS"
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
    echo "recompute path: $(grep -c "^CHECK.*PASS" "$log_dir/lineage_train_recompute.log") checks pass"
  fi
  if [ -n "${KDA_PROFILE:-}" ]; then
    echo "== kda_gpu_train --profile: a 125M step's time by stage (softmax, then the KDA hybrid)"
    timeout 120 ./build-gpu-app/bin/kda_gpu_train --profile 2>&1 | tee "$log_dir/train_profile.log" |
      grep -E "PROFILE|BENCH"
  fi
  if [ -n "${KDA_NSYS:-}" ] && command -v nsys >/dev/null; then
    echo "== nsys: where a 125M softmax training step spends its time (kernels, top 30)"
    timeout 120 nsys profile -t cuda -o "$log_dir/train_profile" --force-overwrite true \
      ./build-gpu-app/bin/kda_gpu_train --profile >/dev/null 2>&1
    nsys stats -r cuda_gpu_kern_sum -f csv "$log_dir/train_profile.nsys-rep" 2>/dev/null |
      python3 -c 'import csv,sys
rows=[r for r in csv.reader(sys.stdin) if len(r)>8]
hdr=rows[0]; rows=rows[1:]
for r in rows[:30]: print("%5s%% %10.2f ms %6s  %s" % (r[0], float(r[1])/1e6, r[2], r[-1][:110]))'
  fi
  if [ -n "${KDA_RECALL:-}" ]; then
    echo "== kda bench recall --device cuda $KDA_RECALL"
    left=$((560 - ($(date +%s) - script_start)))
    # shellcheck disable=SC2086
    timeout -k 10 "$left" ./build-gpu-app/bin/kda bench recall --device cuda --out "$log_dir/recall" \
      $KDA_RECALL 2>&1 | tail -40
  fi
  echo "== table"
  grep "^BENCH" "$log_dir/train_kernels.log" "$log_dir/attention_rows16.log" \
    "$log_dir/lineage_train.log" 2>/dev/null | sed 's/^[^:]*://'
  exit "$status"
fi
# FlashKDA beside fla (the full run only; GPU_NOTES "Preparing gpu_carry"): built in the
# background while ours builds and checks, then timed in the same call (a later call has been
# seen not to find it)
flashkda_dir=flashkda_carry/flashkda
flashkda_pid=""
if { [ "$mode" = "all" ] || [ "$mode" = "--flashkda" ]; } && [ -f "$flashkda_dir/setup.py" ]; then
  echo "== FlashKDA: building in the background ($log_dir/flashkda_build.log)"
  (cd "$flashkda_dir" && FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=4 \
    python3 setup.py build_ext --inplace) >"$log_dir/flashkda_build.log" 2>&1 &
  flashkda_pid=$!
fi
# KDA_GPU_BIN: a kda_gpu_check built elsewhere (sm_90a, KDA_NATIVE=OFF) and carried along; used
# when it loads on this machine (an unknown flag must give the usage error, exit 2).
bin=./build-gpu/bin/kda_gpu_check
if [ -n "${KDA_GPU_BIN:-}" ] && { "$KDA_GPU_BIN" --probe >/dev/null 2>&1; [ $? -eq 2 ]; }; then
  bin="$KDA_GPU_BIN"
  echo "== using the carried binary $bin"
else
  echo "== configure + build (build-gpu, sm_90a)"
  start=$(date +%s)
  if ! cmake --preset gpu >"$log_dir/configure.log" 2>&1; then
    tail -40 "$log_dir/configure.log"
    exit 1
  fi
  if ! cmake --build build-gpu --target kda_gpu_check kda_gpu_model -j "$(nproc)" \
    >"$log_dir/build.log" 2>&1; then
    grep -E "error|warning" -A3 "$log_dir/build.log" | head -60
    exit 1
  fi
  # the device tool brings back at most 8 files: the build's logs only when it fails
  rm -f "$log_dir/configure.log" "$log_dir/build.log"
  echo "built in $(($(date +%s) - start)) s"
fi
# registers / stack / spills of the kernels (the compiler's resource report, from the binary)
if command -v cuobjdump >/dev/null; then
  cuobjdump -res-usage "$bin" 2>/dev/null >/tmp/kda_res_usage.log
  awk '/Function/{f=$2} /REG:/{print $1, $2, $4, f}' /tmp/kda_res_usage.log |
    { command -v c++filt >/dev/null && c++filt || cat; } |
    grep -E "chunk_state_kernel|decode_kernel|chunk_prepare_kernel" | cut -c1-150 | sort -u
fi

# --flashkda: the KDA forward rows alone beside fla and FlashKDA (a short call), whole table
# (KDA_PEER_ROWS=chunk: the Gated DeltaNet rows and fla's too; KDA_PEER_SECONDS: the budget)
if [ "$mode" = "--flashkda" ]; then
  KDA_BENCH_ONLY=${KDA_PEER_ROWS:-kda} timeout 120 "$bin" --bench --out "$log_dir/ours.tsv" \
    >"$log_dir/check_bench.log" 2>&1
  grep "^BENCH" "$log_dir/check_bench.log"
  if [ "${KDA_PEER_ROWS:-kda}" = kda ]; then
    time_peers "${KDA_PEER_SECONDS:-330}" --only-kda
  else
    time_peers "${KDA_PEER_SECONDS:-330}"
  fi
  exit 0
fi

model_status=0
if [ "$mode" != "--bench-only" ] && [ -x ./build-gpu/bin/kda_gpu_model ]; then
  model_args=(--check --shared gpu_carry/shared)
  [ "$mode" != "--check-only" ] && model_args+=(--bench)
  echo "== kda_gpu_model ${model_args[*]}"
  timeout 300 ./build-gpu/bin/kda_gpu_model "${model_args[@]}" 2>&1 | tee "$log_dir/model.log" |
    grep -v "^CHECK.*PASS"
  model_status=${PIPESTATUS[0]}
  echo "model path: exit $model_status ($(grep -c "^CHECK.*PASS" "$log_dir/model.log") checks pass)"
fi

# The kda binary itself on the GPU (kda verify / kda run --device cuda) when PCRE2's development
# files were carried (gpu_carry/pcre2: pcre2.h, libpcre2-8.so, a relocatable .pc; the image has
# no libpcre2-dev): a Debian copy of the library, found through PKG_CONFIG_PATH.
if [ "$mode" = "--model" ] && [ -d gpu_carry/pcre2 ]; then
  echo "== kda binary with CUDA (build-gpu-app)"
  export PKG_CONFIG_PATH="$PWD/gpu_carry/pcre2/lib/pkgconfig" LD_LIBRARY_PATH="$PWD/gpu_carry/pcre2/lib"
  if cmake -S . -B build-gpu-app -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DKDA_TESTS=OFF >"$log_dir/configure_app.log" 2>&1 &&
    cmake --build build-gpu-app --target kda -j "$(nproc)" >"$log_dir/build_app.log" 2>&1; then
    ./build-gpu-app/bin/kda verify --device cuda gpu_carry/shared/models 2>&1 | tail -12
    for dtype in bf16 fp32; do
      ./build-gpu-app/bin/kda run -m models/kimi-mini -p "The jury said that the city" -n 48 \
        --temp 0.8 --top-k 40 --seed 1 --device cuda --dtype "$dtype" 2>&1
      echo
    done
    ./build-gpu-app/bin/kda run -m models/kimi-mini -p "The jury said that the city" -n 48 \
      --temp 0.8 --top-k 40 --seed 1 2>&1
    echo
    # decode of several sequences a step on the GPU (their steps side by side on their streams)
    echo "== kda bench decode --device cuda --batch 4,16"
    timeout 120 ./build-gpu-app/bin/kda bench decode --device cuda --batch 4,16 \
      --out "$log_dir/decode_gpu" 2>&1 | grep -E "^decode|^prompt|^prefill"
  else
    grep -E "error" -A3 "$log_dir/configure_app.log" "$log_dir/build_app.log" | head -30
    model_status=1
  fi
fi

args=(--out "$log_dir/ours.tsv")
case "$mode" in
  --check-only) args+=(--check) ;;
  --bench-only) args+=(--bench) ;;
  --no-fla) args+=(--check --bench) ;;
  --model) args+=(--check) ;;
  *) args+=(--check --bench) ;;
esac
echo "== kda_gpu_check ${args[*]}"
timeout 420 "$bin" "${args[@]}" 2>&1 | tee "$log_dir/check_bench.log"
status=${PIPESTATUS[0]}
if [ "$mode" != "--bench-only" ]; then
  # The check shapes are too small for the automatic choice to take the wgmma state walks
  # (full grids only): every check again with both forced on.
  echo "== kda_gpu_check --check with the wgmma walks forced (KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1)"
  KDA_STATE_WGMMA=1 KDA_STATE_BWD_WGMMA=1 timeout 150 "$bin" --check >"$log_dir/check_wgmma.log" 2>&1 ||
    status=1
  grep -E "FAIL|summary" "$log_dir/check_wgmma.log" | head -20
fi
[ "$model_status" -ne 0 ] && status=$model_status
if [ "$mode" = "--check-only" ] || [ "$mode" = "--model" ]; then
  grep "^BENCH" "$log_dir/model.log" 2>/dev/null
  exit "$status"
fi

echo "== compute-sanitizer (one small forward + backward; memcheck, then racecheck)"
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$bin" --small >"$log_dir/sanitizer_$tool.log" 2>&1
    echo "$tool: exit $? ($(grep -c "^CHECK.*PASS" "$log_dir/sanitizer_$tool.log") checks pass)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|hazard" "$log_dir/sanitizer_$tool.log" | head -8
  done
else
  echo "compute-sanitizer not found"
fi

if [ "$mode" = "--no-fla" ]; then
  grep "^BENCH" "$log_dir/check_bench.log"
  exit "$status"
fi
echo "== fla (same shapes, same run)"
# whatever is left of ~9.5 minutes (the device tool's per-call limit is 10)
time_peers 570
exit "$status"
