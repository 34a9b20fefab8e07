#!/usr/bin/env bash
# Assembles a CUDA 13.0 toolkit from NVIDIA's PyPI wheels on a machine without a GPU, so that
# build.sh --cuda-root can build the CUDA llama-bench here rather than on the GPU machine, whose
# time is scarce (a 12-job build there takes about 5 minutes; 2 cores here 25).
#
# Usage: bench/llamacpp/cuda_toolkit.sh [--dir DIR] [--wheels DIR]
#   --dir     where the toolkit goes (default .llamacpp/cuda-13.0)
#   --wheels  where the wheels are downloaded to (default /tmp/cuda-wheels)
#
# The versions are pinned to the GPU machine's (nvcc 13.0, driver 580): the binary links
# libcudart.so.13 and libcublas.so.13 and finds them there through its RUNPATH. libcuda.so, the
# driver, is not in any wheel; a stub exporting every function cuda.h declares stands in for it at
# link time (as the toolkit's own lib64/stubs/libcuda.so does), and the machine's driver is
# loaded at run time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="$ROOT/.llamacpp/cuda-13.0"
WHEELS=/tmp/cuda-wheels
PINNED=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
        nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14)

die() { echo "cuda_toolkit.sh: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) [ $# -ge 2 ] || die "option --dir needs a value"; DIR="$2"; shift 2 ;;
        --wheels) [ $# -ge 2 ] || die "option --wheels needs a value"; WHEELS="$2"; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
command -v gcc >/dev/null || die "gcc not found (the driver stub is compiled with it)"

mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    -d "$WHEELS" "${PINNED[@]}" || die "pip could not download ${PINNED[*]}"

staging="$DIR.partial"
rm -rf "$staging" && mkdir -p "$staging"
for spec in "${PINNED[@]}"; do
    name="${spec%%==*}"; version="${spec##*==}"
    wheel=$(ls "$WHEELS/${name//-/_}-$version-"*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || die "no wheel for $spec in $WHEELS"
    python3 -m zipfile -e "$wheel" "$staging/unpacked" || die "cannot unpack $wheel"
done
# The wheels put the toolkit under nvidia/cu13 with lib/ where nvcc.profile and CMake look for lib64/.
mv "$staging/unpacked/nvidia/cu13" "$staging/toolkit"
tk="$staging/toolkit"
chmod +x "$tk"/bin/* "$tk"/nvvm/bin/* 2>/dev/null || true
ln -sfn lib "$tk/lib64"
for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "$tk/lib/lib$lib.so"; done
mkdir -p "$tk/lib/stubs"
echo '#include <cuda.h>' | gcc -E -I "$tk/include" - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
    | tr -d ' (' | sort -u | awk '{print "void " $1 "(void) {}"}' > "$staging/libcuda-stub.c"
[ -s "$staging/libcuda-stub.c" ] || die "found no driver functions in $tk/include/cuda.h"
gcc -shared -fPIC -o "$tk/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$staging/libcuda-stub.c" \
    || die "cannot build the driver stub"
"$tk/bin/nvcc" --version >/dev/null || die "$tk/bin/nvcc does not run"
rm -rf "$DIR" && mv "$tk" "$DIR" && rm -rf "$staging"
echo "CUDA toolkit in $DIR ($("$DIR/bin/nvcc" --version | tail -1)); build with:"
echo "  bench/llamacpp/build.sh --cuda-root $DIR --out .llamacpp/pack"
