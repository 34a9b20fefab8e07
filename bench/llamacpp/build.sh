#!/usr/bin/env bash
# Builds llama.cpp's llama-bench (the peer contender of bench/e2e) from the tarball that
# pack_source.sh writes, or reuses a binary carried from an earlier run.
#
# Usage: bench/llamacpp/build.sh [--cpu] [--jobs N] [--nice N] [--src TARBALL] [--bin-dir DIR]
#                                [--pack-dir DIR] [--work DIR] [--log FILE] [--out DIR] [--force]
#                                [--cuda-root DIR]
#   --cpu       build without CUDA (default: CUDA for sm_90, the H200)
#   --cuda-root DIR  build the CUDA flavour with the toolkit in DIR (cuda_toolkit.sh assembles one
#               from PyPI wheels), on a machine without a GPU: the binary finds the CUDA libraries
#               in the GPU machine's /usr/local/cuda through its RUNPATH, and cannot be run (--help)
#               until it is there; pack it with --out and carry it in .llamacpp/pack
#   --jobs N    parallel compile jobs (default: nproc)
#   --nice N    run the build at this niceness (default 0; e.g. 19 while a benchmark runs)
#   --src       source tarball (default .llamacpp/llama.cpp-src.tar.gz)
#   --bin-dir   where the binaries end up (default .llamacpp/bin; bench/e2e looks there)
#   --pack-dir  compressed pieces carried from an earlier --out (default .llamacpp/pack):
#               reassembled into --bin-dir instead of building when present
#   --work      scratch folder for sources and objects (default /tmp/llamacpp-build-<flavour>)
#   --log       build log (default .llamacpp/build-<flavour>.log)
#   --out DIR   afterwards, write the binaries to DIR xz-compressed and split into <= 15 MiB
#               pieces, with REASSEMBLE.txt (the command to rebuild them, and their sha256),
#               plus the build log; copy DIR's files to --pack-dir to carry them later
#   --force     build even when a usable binary or pack is present
# Meant to run in the background while other work uses the machine:
#   bench/llamacpp/build.sh --nice 10 --jobs 12 --out "$OUT/llamacpp" &
# Exit status 0 only when --bin-dir/llama-bench runs (`--help`; with --cuda-root, where it cannot,
# when it was built) and matches the flavour.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FLAVOUR=cuda
JOBS="$(nproc)"
NICE=0
SRC="$ROOT/.llamacpp/llama.cpp-src.tar.gz"
BIN_DIR="$ROOT/.llamacpp/bin"
PACK_DIR="$ROOT/.llamacpp/pack"
WORK=""
LOG=""
OUT=""
FORCE=0
CUDA_ROOT=""
# Where the GPU machine keeps libcudart.so.13 and libcublas.so.13 (its toolkit's).
MACHINE_CUDA_LIBS=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
TARGETS=(llama-bench)
PIECE_BYTES=$((15 * 1024 * 1024))
PACK_NAME=llamacpp-bin.tar.xz

die() { echo "build.sh: $*" >&2; exit 1; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "option $1 needs a value (see --help)"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) FLAVOUR=cpu; shift ;;
        --cuda-root) need_value "$@"; CUDA_ROOT="$2"; shift 2 ;;
        --jobs) need_value "$@"; JOBS="$2"; shift 2 ;;
        --nice) need_value "$@"; NICE="$2"; shift 2 ;;
        --src) need_value "$@"; SRC="$2"; shift 2 ;;
        --bin-dir) need_value "$@"; BIN_DIR="$2"; shift 2 ;;
        --pack-dir) need_value "$@"; PACK_DIR="$2"; shift 2 ;;
        --work) need_value "$@"; WORK="$2"; shift 2 ;;
        --log) need_value "$@"; LOG="$2"; shift 2 ;;
        --out) need_value "$@"; OUT="$2"; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, got '$JOBS'"
[[ "$NICE" =~ ^-?[0-9]+$ ]] && [ "$NICE" -ge -20 ] && [ "$NICE" -le 19 ] \
    || die "--nice must be an integer in -20..19, got '$NICE'"
if [ -n "$CUDA_ROOT" ]; then
    [ "$FLAVOUR" = cuda ] || die "--cuda-root builds the CUDA flavour; it cannot go with --cpu"
    [ -x "$CUDA_ROOT/bin/nvcc" ] || die "--cuda-root '$CUDA_ROOT' has no bin/nvcc (make one with bench/llamacpp/cuda_toolkit.sh)"
    CUDA_ROOT="$(cd "$CUDA_ROOT" && pwd)"
fi
WORK="${WORK:-/tmp/llamacpp-build-$FLAVOUR}"
LOG="${LOG:-$ROOT/.llamacpp/build-$FLAVOUR.log}"
mkdir -p "$(dirname "$LOG")" "$BIN_DIR"
: > "$LOG"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
fail() {
    log "FAILED: $*"
    [ -z "$OUT" ] || { mkdir -p "$OUT" && cp "$LOG" "$OUT/build.log"; }
    exit 1
}
[ "$NICE" -eq 0 ] || renice -n "$NICE" -p $$ >/dev/null || fail "renice to $NICE refused"

# A binary is usable when it starts and was built for the flavour asked for (a CPU build
# carried to the GPU machine would start fine and then measure the wrong thing).
usable() {
    local bin="$BIN_DIR/llama-bench"
    [ -x "$bin" ] || return 1
    grep -qx "flavour=$FLAVOUR" "$BIN_DIR/BUILD_INFO" 2>/dev/null \
        || { log "$bin is not a $FLAVOUR build ($(grep '^flavour=' "$BIN_DIR/BUILD_INFO" 2>/dev/null || echo 'no BUILD_INFO'))"; return 1; }
    if [ -n "$CUDA_ROOT" ]; then
        log "$bin cannot start here (no GPU driver): built against $CUDA_ROOT, it runs where $MACHINE_CUDA_LIBS holds CUDA 13"
        return 0
    fi
    "$bin" --help >/dev/null 2>>"$LOG" || { log "$bin --help failed (missing libraries?)"; return 1; }
}

unpack() {
    [ -f "$PACK_DIR/REASSEMBLE.txt" ] || return 1
    log "reassembling the binaries carried in $PACK_DIR"
    local sum
    sum="$(sed -n 's/^sha256 //p' "$PACK_DIR/REASSEMBLE.txt")"
    [ -n "$sum" ] || { log "$PACK_DIR/REASSEMBLE.txt names no sha256"; return 1; }
    cat "$PACK_DIR/$PACK_NAME".part-* > "$WORK.pack.tar.xz" || { log "no $PACK_NAME.part-* in $PACK_DIR"; return 1; }
    echo "$sum  $WORK.pack.tar.xz" | sha256sum -c --quiet - >>"$LOG" 2>&1 \
        || { log "the pieces in $PACK_DIR do not match their sha256 (incomplete copy?)"; rm -f "$WORK.pack.tar.xz"; return 1; }
    tar xJf "$WORK.pack.tar.xz" -C "$BIN_DIR" >>"$LOG" 2>&1 || { log "cannot unpack $WORK.pack.tar.xz"; return 1; }
    rm -f "$WORK.pack.tar.xz"
}

build() {
    [ -f "$SRC" ] || fail "source tarball '$SRC' not found (make it with bench/llamacpp/pack_source.sh)"
    command -v cmake >/dev/null || fail "cmake not found"
    command -v ninja >/dev/null || fail "ninja not found"
    local cmake_flags=(
        -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    )
    if [ -n "$CUDA_ROOT" ]; then
        export PATH="$CUDA_ROOT/bin:$PATH"
        # The toolkit's directory means nothing on the GPU machine: no build RPATH, the machine's instead.
        cmake_flags+=(-DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_ROOT"
                      -DCMAKE_SKIP_BUILD_RPATH=ON -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath,$MACHINE_CUDA_LIBS")
    fi
    if [ "$FLAVOUR" = cuda ]; then
        command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || fail "nvcc not found (use --cpu for a CPU build)"
        command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
        # One GPU: NCCL would only add a dependency. 90-real: sm_90 machine code alone, without the
        # compute_90 PTX that "90" embeds for JIT on other GPUs (the same kernels on the H200/H100,
        # and a binary small enough to carry).
        cmake_flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_NCCL=OFF)
    else
        cmake_flags+=(-DGGML_CUDA=OFF)
    fi
    log "unpacking $SRC into $WORK"
    rm -rf "$WORK" && mkdir -p "$WORK"
    tar xzf "$SRC" -C "$WORK" || fail "cannot unpack $SRC"
    local src="$WORK/llama.cpp"
    local commit
    commit="$(head -1 "$src/LLAMACPP_COMMIT" 2>/dev/null || echo unknown)"
    cmake_flags+=(-DLLAMA_BUILD_COMMIT="${commit:0:12}")
    # The sources carry no .git: keep CMake's build-info from finding an enclosing repository.
    export GIT_CEILING_DIRECTORIES="$WORK"
    log "configuring ($FLAVOUR, llama.cpp $commit): cmake ${cmake_flags[*]}"
    cmake -S "$src" -B "$WORK/build" "${cmake_flags[@]}" >>"$LOG" 2>&1 || fail "cmake configure failed (see $LOG)"
    log "building ${TARGETS[*]} with $JOBS jobs"
    local t0=$SECONDS
    cmake --build "$WORK/build" -j "$JOBS" --target "${TARGETS[@]}" >>"$LOG" 2>&1 || fail "build failed (see $LOG)"
    log "built in $((SECONDS - t0)) s"
    for t in "${TARGETS[@]}"; do
        install -m 755 "$WORK/build/bin/$t" "$BIN_DIR/$t" || fail "cannot install $t into $BIN_DIR"
        strip "$BIN_DIR/$t" 2>>"$LOG" || log "strip $t failed; keeping it unstripped"
    done
    {
        echo "flavour=$FLAVOUR"
        echo "commit=$commit"
        echo "source=$(sed -n 2p "$src/LLAMACPP_COMMIT" 2>/dev/null)"
        echo "compiler=$(gcc --version | head -1)"
        [ "$FLAVOUR" = cpu ] || echo "nvcc=$(nvcc --version | tail -1)"
        [ -z "$CUDA_ROOT" ] || echo "cuda_root=$CUDA_ROOT (built without a GPU; RUNPATH $MACHINE_CUDA_LIBS)"
        echo "cmake=${cmake_flags[*]}"
        echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    } > "$BIN_DIR/BUILD_INFO"
}

write_out() {
    mkdir -p "$OUT"
    local files=("${TARGETS[@]}" BUILD_INFO)
    log "packing ${files[*]} into $OUT ($PACK_NAME, pieces of at most $PIECE_BYTES bytes)"
    rm -f "$OUT/$PACK_NAME".part-*
    tar cf - -C "$BIN_DIR" "${files[@]}" | xz -T0 -6 | split -b "$PIECE_BYTES" -d -a 2 - "$OUT/$PACK_NAME.part-" \
        || fail "cannot pack the binaries into $OUT"
    local sum
    sum="$(cat "$OUT/$PACK_NAME".part-* | sha256sum | cut -d' ' -f1)"
    {
        echo "# The llama.cpp binaries (${files[*]}), $FLAVOUR build, xz-compressed and split."
        echo "# Copy these files into .llamacpp/pack/ and build.sh reassembles them; by hand:"
        echo "#   cat $PACK_NAME.part-* | tar xJf - -C .llamacpp/bin"
        echo "sha256 $sum"
    } > "$OUT/REASSEMBLE.txt"
    cp "$LOG" "$OUT/build.log"
    local n
    n="$(ls "$OUT/$PACK_NAME".part-* | wc -l)"
    log "wrote $n piece(s), $(cat "$OUT/$PACK_NAME".part-* | wc -c) bytes in all, sha256 $sum"
}

if [ "$FORCE" -eq 0 ] && usable; then
    log "using the existing $BIN_DIR/llama-bench ($FLAVOUR)"
elif [ "$FORCE" -eq 0 ] && unpack && usable; then
    log "using the binaries reassembled from $PACK_DIR ($FLAVOUR)"
else
    build
    usable || fail "the freshly built $BIN_DIR/llama-bench does not run (see $LOG)"
    log "ready: $BIN_DIR/llama-bench ($FLAVOUR)"
fi
[ -z "$OUT" ] || write_out
