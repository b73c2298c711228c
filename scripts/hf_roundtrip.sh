#!/usr/bin/env bash
# Do transformers read the checkpoints kda writes as kda does? Three steps, the middle one on a
# machine with torch and transformers (the GPU machine has both):
#   bash scripts/hf_roundtrip.sh prepare DIR      # here: tiny Kimi Linear and GPT-2 trained by
#                                                 # `kda train --model`, as run folders and exports
#   python3 scripts/hf_reference.py --out REF DIR/* models/kimi-mini --no-grads kimi-mini
#   bash scripts/hf_roundtrip.sh verify DIR REF   # here: `kda verify` on each folder + REF's
#                                                 # reference (logits, loss, greedy, gradients)
set -euo pipefail
cd "$(dirname "$0")/.."
kda=build/bin/kda
fixtures=${KDA_SHARED:-../shared}/fixtures/models

case "${1:-}" in
prepare)
  dir=$2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$dir"
  for arch in kimi_linear gpt2; do
    # the fixture models' configs, trained from fresh weights for a few steps on MQAR
    $kda train --model "$fixtures/${arch}_tiny/config.json" --out "$work/${arch}_run" --task mqar \
      --vocab 1000 --seq-len 64 --steps 40 --batch 4 --seed 3 | tail -n 1
    $kda export "$work/${arch}_run" "$work/${arch}_export"
    for kind in run export; do
      mkdir -p "$dir/${arch}_$kind"
      cp "$work/${arch}_$kind/config.json" "$work/${arch}_$kind/model.safetensors" "$dir/${arch}_$kind/"
    done
  done
  ;;
verify)
  dir=$2 ref=$3
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  status=0
  for r in "$ref"/*/; do
    name=$(basename "$r")
    src="$dir/$name"
    [ -d "$src" ] || src="models/$name"
    mkdir -p "$work/$name"
    cp "$src"/* "$work/$name/" 2>/dev/null || true
    cp -r "$r"/. "$work/$name/"
    echo "== $name (weights from $src)"
    $kda verify "$work/$name" || status=1
  done
  exit $status
  ;;
*)
  echo "usage: $0 prepare DIR | verify DIR REF" >&2
  exit 2
  ;;
esac
