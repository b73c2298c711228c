#!/usr/bin/env bash
# Do transformers read the checkpoints kda writes as kda does? Three steps, the middle one on a
# machine with torch and transformers (the GPU machine has both):
#   bash scripts/hf_roundtrip.sh prepare DIR      # here: tiny Kimi Linear and GPT-2 trained by
#                                                 # `kda train --model`, as run folders and exports
#   python3 scripts/hf_reference.py --out REF DIR/*_run DIR/*_export models/kimi-mini \
#     --no-grads kimi-mini --random-config DIR/kimi_linear_qlora.json
#   bash scripts/hf_roundtrip.sh verify DIR REF   # here: `kda verify` on each folder + REF's
#                                                 # reference (logits, loss, greedy, gradients)
# The last model goes the other way: transformers makes it (random weights) from a config with
# the paths the fixtures lack (q_lora_rank, convolution width 3, grouped routing, two shared
# experts, two MLA layers), and kda reads what transformers saved.
set -euo pipefail
# DIR and REF as given from the caller's folder; the commands run from the repository root
args=()
for a in "$@"; do case "$a" in prepare | verify) args+=("$a") ;; *) args+=("$(realpath -m "$a")") ;; esac; done
set -- "${args[@]}"
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
  cat > "$dir/kimi_linear_qlora.json" <<'JSON'
{"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
 "vocab_size": 300, "hidden_size": 48, "num_hidden_layers": 5, "intermediate_size": 80,
 "rms_norm_eps": 1e-5, "model_max_length": 2048, "tie_word_embeddings": false,
 "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
 "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [2, 5], "num_heads": 3,
                        "head_dim": 16, "short_conv_kernel_size": 3},
 "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 24, "kv_lora_rank": 20,
 "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 10, "mla_use_nope": true,
 "first_k_dense_replace": 2, "moe_layer_freq": 1, "num_experts": 6,
 "num_experts_per_token": 3, "num_shared_experts": 2, "moe_intermediate_size": 16,
 "moe_router_activation_func": "sigmoid", "moe_renormalize": true,
 "routed_scaling_factor": 1.7, "use_grouped_topk": true, "num_expert_group": 2,
 "topk_group": 1}
JSON
  ;;
verify)
  dir=$2 ref=$3
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  status=0
  shopt -s nullglob
  refs=("$ref"/*/)
  [ ${#refs[@]} -gt 0 ] || { echo "no reference folders in $ref" >&2; exit 1; }
  for r in "${refs[@]}"; do
    name=$(basename "$r")
    src="$dir/$name"  # a folder kda wrote, the embedded model, or one transformers saved in REF
    [ -d "$src" ] || src="models/$name"
    [ -f "$r/model.safetensors" ] && src="$r"
    [ -f "$src/model.safetensors" ] || { echo "no weights for $name" >&2; status=1; continue; }
    mkdir -p "$work/$name"
    cp "$src/config.json" "$src/model.safetensors" "$work/$name/"
    for f in vocab.json merges.txt tiktoken.model tokenizer_config.json; do
      [ -f "$src/$f" ] && cp "$src/$f" "$work/$name/"
    done
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
