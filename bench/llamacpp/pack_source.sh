#!/usr/bin/env bash
# Packs llama.cpp's sources, as vendored in the llama-cpp-python sdist, into one small tarball
# that travels with the working tree to a machine without network (where build.sh builds it).
#
# Usage: bench/llamacpp/pack_source.sh [--sdist PATH] [--out PATH]
#   --sdist  llama_cpp_python-<version>.tar.gz (default /tmp/llama/llama_cpp_python-0.3.36.tar.gz;
#            fetch it with: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama)
#   --out    the tarball to write (default .llamacpp/llama.cpp-src.tar.gz at the repository root)
#
# Left out (not needed to build llama-bench with the CPU and CUDA backends): models/ (vocab GGUFs),
# docs/, media/, tests/, benches/, tools/ui (the web UI), test media, the Python converters'
# data, and every ggml backend except ggml-cpu and ggml-cuda. app/ and vendor/ stay: CMake
# adds them unconditionally. The vendored commit is written to LLAMACPP_COMMIT because the
# tarball carries no .git for CMake's build-info to read.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SDIST=/tmp/llama/llama_cpp_python-0.3.36.tar.gz
OUT="$ROOT/.llamacpp/llama.cpp-src.tar.gz"
# The tarball must leave room in the 64 MiB carried to the device for the prebuilt binaries.
MAX_BYTES=$((20 * 1024 * 1024))

while [ $# -gt 0 ]; do
    case "$1" in
        --sdist) SDIST="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "pack_source.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

[ -f "$SDIST" ] || { echo "pack_source.sh: sdist '$SDIST' not found (pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(dirname "$SDIST"))" >&2; exit 1; }

# An sdist's top folder is its file name without .tar.gz (reading tar's listing through
# `head` would trip pipefail with SIGPIPE).
TOP="$(basename "$SDIST" .tar.gz)"
SRC="$TOP/vendor/llama.cpp"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

tar xzf "$SDIST" -C "$STAGE" \
    --exclude="$SRC/models" --exclude="$SRC/docs" --exclude="$SRC/media" \
    --exclude="$SRC/tests" --exclude="$SRC/benches" --exclude="$SRC/tools/ui" \
    --exclude="$SRC/tools/server/tests" --exclude="$SRC/tools/mtmd/test-*" \
    --exclude="$SRC/.github" --exclude="$SRC/.devops" --exclude="$SRC/.git" \
    "$SRC" "$TOP/.git/modules/vendor/llama.cpp/HEAD"

# ggml_add_backend() only descends into a backend's folder when it is enabled.
for dir in "$STAGE/$SRC"/ggml/src/ggml-*/; do
    case "$(basename "$dir")" in
        ggml-cpu|ggml-cuda) ;;
        *) rm -rf "$dir" ;;
    esac
done
[ -f "$STAGE/$SRC/CMakeLists.txt" ] || { echo "pack_source.sh: '$SDIST' has no $SRC/CMakeLists.txt" >&2; exit 1; }
[ -f "$STAGE/$SRC/tools/llama-bench/llama-bench.cpp" ] || { echo "pack_source.sh: '$SDIST' has no llama-bench sources" >&2; exit 1; }

COMMIT="$(cat "$STAGE/$TOP/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)"
printf '%s\n%s\n' "$COMMIT" "$(basename "$SDIST")" > "$STAGE/$SRC/LLAMACPP_COMMIT"

mkdir -p "$(dirname "$OUT")"
mv "$STAGE/$SRC" "$STAGE/llama.cpp"
tar czf "$OUT.tmp" -C "$STAGE" llama.cpp
mv "$OUT.tmp" "$OUT"

SIZE=$(stat -c %s "$OUT")
echo "pack_source.sh: wrote $OUT: $SIZE bytes ($((SIZE / 1024)) KiB), llama.cpp commit $COMMIT"
if [ "$SIZE" -gt "$MAX_BYTES" ]; then
    echo "pack_source.sh: $OUT is larger than $MAX_BYTES bytes: it would crowd out the carried binaries" >&2
    exit 1
fi
