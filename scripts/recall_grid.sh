#!/usr/bin/env bash
# The recall grid on every GPU of the device machine: one `kda bench recall --shard I/N` process
# per GPU (CUDA_VISIBLE_DEVICES=I), each started in its own session (setsid) so that it outlives
# the device call that started it while the machine stays held, all continuing from one runs
# file. Later calls collect what finished.
#
#   scripts/recall_grid.sh start DIR [kda bench recall options...]
#       DIR/recall_runs.jsonl (copied from docs/recall_v8192_runs.jsonl by the caller, or
#       empty) seeds every shard; shard I trains in DIR/shard_I and logs to DIR/shard_I.log.
#   scripts/recall_grid.sh wait DIR SECONDS
#       waits until every shard has exited or SECONDS have passed, then merges.
#   scripts/recall_grid.sh merge DIR
#       appends every shard's finished runs to DIR/recall_runs.jsonl (each run once) and
#       prints the table of what it holds (--no-train, with the options `start` was given).
#
# The binary: build-gpu-app/bin/kda (scripts/gpu_run.sh --train builds it; KDA_BIN overrides).
# Options: those of kda bench recall except --out, --continue and --shard (set here); they must
# include --device cuda and match the runs file's settings for its runs to be reused.
set -uo pipefail
cd "$(dirname "$0")/.."
kda="${KDA_BIN:-./build-gpu-app/bin/kda}"
command="${1:-}"
dir="${2:-}"
[ -n "$command" ] && [ -n "$dir" ] || {
  sed -n '2,20p' "$0"
  exit 2
}

merge() {
  local all="$dir/recall_runs.jsonl"
  touch "$all"
  # each run once: the seed lines are in every shard's file too (awk reads the files one by
  # one, so a file cut inside its last line cannot glue it to the next file's first)
  awk 'NF && !seen[$0]++' "$all" "$dir"/shard_*/recall_runs.jsonl >"$all.new" 2>/dev/null
  mv "$all.new" "$all"
  echo "== $(wc -l <"$all") runs in $all"
  local options=()
  mapfile -t options <"$dir/options"
  "$kda" bench recall "${options[@]}" --no-train --out "$dir" | tail -12
}

case "$command" in
  start)
    shift 2
    mkdir -p "$dir"
    for pid_file in "$dir"/shard_*.pid; do
      if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
        echo "shards of $dir are still running: wait for them (or kill them) first"
        exit 1
      fi
    done
    touch "$dir/recall_runs.jsonl"
    printf '%s\n' "$@" >"$dir/options"  # one option a line: quoting survives
    [ -n "$(ls "$dir"/shard_* 2>/dev/null)" ] && merge >/dev/null  # keep unmerged runs
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
    [ "$gpus" -ge 1 ] || {
      echo "no GPU found"
      exit 1
    }
    for ((i = 0; i < gpus; ++i)); do
      mkdir -p "$dir/shard_$i"
      cp "$dir/recall_runs.jsonl" "$dir/shard_$i/recall_runs.jsonl"
      CUDA_VISIBLE_DEVICES=$i setsid nohup "$kda" bench recall "$@" --continue \
        --shard "$i/$gpus" --out "$dir/shard_$i" >"$dir/shard_$i.log" 2>&1 </dev/null &
      echo $! >"$dir/shard_$i.pid"
    done
    sleep 5
    grep -h "training .* missing runs" "$dir"/shard_*.log || tail -3 "$dir"/shard_*.log
    ;;
  wait)
    seconds="${3:?wait needs SECONDS}"
    start=$(date +%s)
    running=0
    while [ $(($(date +%s) - start)) -lt "$seconds" ]; do
      running=0
      for pid_file in "$dir"/shard_*.pid; do
        kill -0 "$(cat "$pid_file")" 2>/dev/null && running=$((running + 1))
      done
      [ "$running" -eq 0 ] && break
      sleep 10
    done
    echo "== $running shard(s) still running after $(($(date +%s) - start)) s"
    merge
    ;;
  merge) merge ;;
  *)
    echo "unknown command '$command' (start, wait, merge)"
    exit 2
    ;;
esac
