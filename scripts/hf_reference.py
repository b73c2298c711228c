#!/usr/bin/env python3
"""Loads model folders in Hugging Face transformers and writes what they compute there.

For each folder (a `kda train --model` run folder, a `kda export` folder, models/kimi-mini, ...)
this writes OUT/<name>/reference.safetensors in the format of ../shared/fixtures/models
(input_ids, logits, loss, greedy_prompt, greedy_out) and, unless --no-grads, the gradient of
that loss for every tensor of the checkpoint in OUT/<name>/grads/model.safetensors. Copy those
beside the folder's config.json and model.safetensors and `kda verify FOLDER` then holds kda's
forward, decode and gradients to transformers' reading of the same files.

The load is strict: a missing, unexpected or mis-shaped tensor is an error, since transformers
would otherwise fill it with fresh random values and the comparison would fail for the wrong
reason. Runs on the CPU in fp32 (the fixtures' setting). Needs torch and transformers (the GPU
machine has both; numpy comes with them); the safetensors package is not needed.
"""

import argparse
import json
import os
import struct
import sys

DTYPE_NAMES = {"torch.float32": "F32", "torch.int64": "I64"}


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype "F32"/"I64", shape, little-endian bytes), in the file's order."""
    header, offset = {"__metadata__": metadata}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, data in tensors.values():
            f.write(data)
    os.replace(tmp, path)


def read_safetensors_names(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return list(header)


def read_safetensors_tensors(path, torch):
    """Every tensor of a safetensors file as float32 (F32, BF16 or F16 as stored)."""
    kinds = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        raw = bytearray(data[begin:end])
        out[name] = torch.frombuffer(raw, dtype=kinds[e["dtype"]]).reshape(e["shape"]).float()
    return out


def locate_stored(stored, holders, torch):
    """Where a stored tensor lives in the loaded model when transformers converted it on load
    (renamed, stacked with the other experts, concatenated as gate + up, transposed, reshaped):
    found by value, since the load copied it exactly. holders: name -> tensor (parameters and
    buffers). Returns (holder name, selector) pairs: selector(g) is the part of a tensor shaped
    like the holder that is the stored tensor; several pairs mean the value is ambiguous."""
    found, seen = [], set()

    def add(name, key, selector):
        if key not in seen:
            seen.add(key)
            found.append((name, selector))

    for name, holder in holders.items():
        x = holder.detach().float()
        if x.numel() == stored.numel() and x.dim() != stored.dim():
            if torch.equal(x.reshape(stored.shape), stored):
                add(name, (id(holder), "reshape"), lambda g: g.reshape(stored.shape))
            continue
        if x.dim() == stored.dim() + 1:  # one expert of a stacked tensor
            views = [(i, x[i]) for i in range(x.shape[0])]
        elif x.dim() == stored.dim():
            views = [(None, x)]
        else:
            continue
        for i, v in views:
            for transposed in (False, True) if v.dim() == 2 else (False,):
                w = v.t() if transposed else v
                for dim in range(w.dim()):
                    if any(w.shape[d] != stored.shape[d] for d in range(w.dim()) if d != dim):
                        continue
                    total, part = w.shape[dim], stored.shape[dim]
                    if part == 0 or total % part:
                        continue
                    for offset in range(0, total, part):
                        if not torch.equal(w.narrow(dim, offset, part), stored):
                            continue
                        if total == part:
                            dim = 0  # the whole view: one key whichever dim found it

                        def selector(g, i=i, transposed=transposed, dim=dim, offset=offset, part=part):
                            g = g if i is None else g[i]
                            g = g.t() if transposed else g
                            return g.narrow(dim, offset, part)

                        add(name, (id(holder), i, transposed, dim, offset), selector)
    return found


def as_entry(t):
    t = t.detach().cpu().contiguous()
    return (DTYPE_NAMES[str(t.dtype)], tuple(t.shape), t.numpy().tobytes())


def load_strict(folder, torch, transformers):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, attn_implementation="eager"
    )
    # a tied head is not stored; the class names it whether or not this config ties it
    tied = []
    if getattr(model.config, "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None) or []  # a list, or {target: source}
    info["missing_keys"] = [k for k in info.get("missing_keys", []) if k not in tied]
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{folder}: transformers did not load every tensor as stored: {problems}")
    return model.eval()


def greedy_no_cache(model, torch, prompt, total):
    """The greedy continuation recomputed from scratch each step: generate() without its cache."""
    ids = prompt
    with torch.no_grad():
        while ids.shape[1] < total:
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def reference_for(folder, out_dir, torch, transformers, tokens, new_tokens, seed, grads):
    model = load_strict(folder, torch, transformers)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen, dtype=torch.int64)

    logits = model(ids, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])

    # generate() is prefill then token-by-token decode through the model's cache; no EOS stop,
    # so the continuation has its full length whatever the model emits
    prompt = ids[:, :12]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        # an explicit mask: otherwise a prompt token equal to pad_token_id reads as padding
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if out.shape[1] != 12 + new_tokens:
        raise SystemExit(f"{folder}: generate() returned {out.shape[1]} tokens, not {12 + new_tokens}")
    plain = greedy_no_cache(model, torch, prompt, 12 + new_tokens)
    cache_vs_plain = int((plain != out).sum())

    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "loss": "mean cross-entropy of logits[:-1] vs ids[1:]; grad.<param> = d loss / d param",
        "reference": f"transformers {transformers.__version__} {type(model).__name__}, fp32, CPU",
        "source": os.path.abspath(folder),
    }
    write_safetensors(
        os.path.join(out_dir, "reference.safetensors"),
        {
            "greedy_out": as_entry(out),
            "greedy_prompt": as_entry(prompt),
            "input_ids": as_entry(ids),
            "logits": as_entry(logits),
            "loss": as_entry(loss.reshape(1)),
        },
        meta,
    )

    grad_count = 0
    if grads:
        loss.backward()
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers())
        entries, unmapped, mapped, stored, holders = {}, [], [], None, None
        for name in read_safetensors_names(os.path.join(folder, "model.safetensors")):
            if name in params:
                p = params[name]
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            elif name in buffers:  # e.g. a router's selection bias: no gradient
                g = torch.zeros_like(buffers[name], dtype=torch.float32)
            else:  # transformers converted it on load (renamed, fused with others): by value
                if stored is None:
                    stored = read_safetensors_tensors(os.path.join(folder, "model.safetensors"), torch)
                    holders = {**{n: p for n, p in params.items()}, **buffers}
                places = locate_stored(stored[name], holders, torch)
                if len(places) != 1:
                    unmapped.append(f"{name} ({len(places)} places by value)")
                    continue
                holder_name, selector = places[0]
                holder = holders[holder_name]
                full = getattr(holder, "grad", None)
                full = full if full is not None else torch.zeros_like(holder, dtype=torch.float32)
                g = selector(full)
                mapped.append(name)
            entries[name] = as_entry(g.float().contiguous())
        if mapped:
            print(f"{folder}: {len(mapped)} stored tensors found by value in the converted model")
        if unmapped:
            print(f"{folder}: no gradients written: {len(unmapped)} stored tensors are not "
                  f"parameters of the loaded model as named, e.g. {unmapped[:3]}")
        else:
            os.makedirs(os.path.join(out_dir, "grads"), exist_ok=True)
            write_safetensors(os.path.join(out_dir, "grads", "model.safetensors"), entries,
                              {"format": "pt"})
            grad_count = len(entries)

    print(
        f"{os.path.basename(os.path.normpath(folder))}: {type(model).__name__}, vocab {vocab}, "
        f"{sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.6f}, "
        f"greedy {out[0, 12:].tolist()[:8]}..., generate vs no-cache greedy: {cache_vs_plain} "
        f"differ, {grad_count} gradients"
    )


def make_random(config_path, out_dir, torch, transformers, seed):
    """A model that transformers itself initialises from a config (seeded, every tensor then
    moved off its init so that biases and norms matter), saved with save_pretrained: the
    direction opposite to the folders kda wrote, for kda's loader."""
    config = transformers.AutoConfig.from_pretrained(config_path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir)  # safetensors, transformers 5's only format
    return out_dir


def self_test(torch):
    """locate_stored on conversions of the kinds transformers applies on load, torch alone."""
    torch.manual_seed(0)
    experts, ffn, width = 4, 6, 5
    gate = [torch.randn(ffn, width) for _ in range(experts)]
    up = [torch.randn(ffn, width) for _ in range(experts)]
    down = [torch.randn(width, ffn) for _ in range(experts)]
    a_log, renamed = torch.randn(3), torch.randn(7, 2)
    holders = {  # stacked + concatenated, stacked + transposed, reshaped, renamed
        "experts.gate_up_proj": torch.stack([torch.cat(p, 0) for p in zip(gate, up)]),
        "experts.down_proj": torch.stack([x.t() for x in down]),
        "A_log": a_log.reshape(1, 1, 3, 1).clone(),
        "mlp.weight": renamed.clone(),
    }
    stored = {"A_log": a_log, "w": renamed}
    for e in range(experts):
        stored.update({f"gate.{e}": gate[e], f"up.{e}": up[e], f"down.{e}": down[e]})
    for name, tensor in stored.items():
        places = locate_stored(tensor, holders, torch)
        if len(places) != 1:
            raise SystemExit(f"self-test: {name} found in {len(places)} places")
        holder, selector = places[0]
        if not torch.equal(selector(holders[holder]), tensor):
            raise SystemExit(f"self-test: {name}'s selector picks another part of {holder}")
    ones = {"n1": torch.ones(4), "n2": torch.ones(4)}
    if len(locate_stored(torch.ones(4), ones, torch)) != 2 or locate_stored(torch.randn(4), ones, torch):
        raise SystemExit("self-test: an ambiguous or absent value was not reported as such")
    print(f"self-test: {len(stored)} converted tensors found by value, ambiguity reported")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*")
    ap.add_argument("--random-config", action="append", default=[],
                    help="a config.json: transformers makes and saves a random model of it first")
    ap.add_argument("--out")
    ap.add_argument("--self-test", action="store_true",
                    help="check the by-value search for converted tensors (needs torch only)")
    ap.add_argument("--tokens", type=int, default=96)  # past one 64-token chunk
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-grads", action="append", default=[],
                    help="a folder name to skip gradients for (repeatable)")
    args = ap.parse_args()

    import torch

    if args.self_test:
        self_test(torch)
        return
    if not args.out:
        ap.error("--out is required")
    import transformers

    torch.manual_seed(args.seed)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    folders = list(args.folders)
    for config_path in args.random_config:
        name = os.path.splitext(os.path.basename(config_path))[0]
        folders.append(make_random(config_path, os.path.join(args.out, name), torch, transformers,
                                   args.seed))
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        reference_for(
            folder, os.path.join(args.out, name), torch, transformers, args.tokens,
            args.new_tokens, args.seed, grads=name not in args.no_grads,
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
