#!/usr/bin/env python3
"""GPT-2's byte-level BPE cut to its first 8192 ids: the 256 byte tokens, the first 7935 merges
(ids 256..8190, in GPT-2's own order, so every kept token's merge path is kept too) and
<|endoftext|> as id 8191. Writes vocab.json + merges.txt (the layout transformers' GPT2Tokenizer
and `kda tokenize` read).

  python3 scripts/make_mini_tokenizer.py GPT2_DIR OUT_DIR   # GPT2_DIR: encoder.json + vocab.bpe
"""
import json
import sys

VOCAB = 8192
src, out = sys.argv[1], sys.argv[2]
encoder = json.load(open(f"{src}/encoder.json", encoding="utf-8"))
merges = open(f"{src}/vocab.bpe", encoding="utf-8").read().split("\n")
header, merges = merges[0], [m for m in merges[1:] if m]
keep = VOCAB - 256 - 1
vocab = {tok: i for tok, i in encoder.items() if i < 256 + keep}
assert len(vocab) == 256 + keep
for i, m in enumerate(merges[:keep]):  # merge i makes id 256 + i
    assert vocab["".join(m.split(" "))] == 256 + i, m
vocab["<|endoftext|>"] = VOCAB - 1
with open(f"{out}/vocab.json", "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False, separators=(",", ":"))
with open(f"{out}/merges.txt", "w", encoding="utf-8") as f:
    f.write(header + "\n" + "\n".join(merges[:keep]) + "\n")
print(f"{out}: {len(vocab)} tokens, {keep} merges")
