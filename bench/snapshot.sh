#!/usr/bin/env bash
# A clean copy of the committed tree for a device call, so uncommitted edits never travel with it:
#   bench/snapshot.sh [DEST=.benchsnap] [MACHINE_JSON]
# DEST gets `git archive HEAD`, a COMMIT file (run_all.sh records it), the carried wheels (.whl/),
# llama.cpp's packed sources and the pieces of a device build of it (.llamacpp/llama.cpp-src.tar.gz,
# .llamacpp/pack/: bench/llamacpp/build.sh) when present, and, when given, an earlier storaged_bench
# JSON as machine.json (for RUN_ALL_MACHINE_JSON).
# Then, with the device tool (carry [DEST]):
#   cd DEST && OUT=$OUT RUN_ALL_E2E_ARGS="--shapes qwen3 ..." bash bench/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.benchsnap}
rm -rf "$dest" && mkdir -p "$dest"
git archive HEAD | tar -x -C "$dest"
git rev-parse HEAD > "$dest/COMMIT"
if [[ -d .whl ]]; then cp -r .whl "$dest/"; fi
for path in .llamacpp/llama.cpp-src.tar.gz .llamacpp/pack; do  # not .llamacpp/bin: a local build is for this CPU
    if [[ -e "$path" ]]; then mkdir -p "$dest/.llamacpp" && cp -r "$path" "$dest/.llamacpp/"; fi
done
if [[ -n "${2:-}" ]]; then cp "$2" "$dest/machine.json"; fi
echo "$dest: $(cat "$dest/COMMIT")$(git diff --quiet HEAD || echo ' (uncommitted changes left out)')"
