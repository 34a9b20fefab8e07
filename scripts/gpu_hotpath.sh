#!/usr/bin/env bash
# The hot path on a GPU machine in one call: correctness of the fast path, then where a decode step's
# time goes for storaged (graph and eager), the resident model and llama.cpp on the same GGUF.
#   (1) carried wheels (.whl/) into /tmp/site; (2) llama.cpp: binaries carried in .llamacpp/pack
#   (bench/llamacpp/build.sh --cuda-root builds them without a GPU) reassembled, else built in the
#   background from its carried source (bench/llamacpp/pack_source.sh) and packed into $OUT/llamacpp;
#   (3) the fast path's tests on the GPU; (4) bench/layer_profile.py on the Qwen3-like shape.
# Logs and JSON land in $OUT (default /tmp/gpu_hotpath); the table of (4) is printed last.
#   (6) with GPU_HOTPATH_COVERAGE=1, the bf16 CUDA column of docs/inference.md's coverage table
#   (scripts/moe_coverage.py --device cuda [--types $GPU_HOTPATH_COVERAGE_TYPES]; the JSON is copied to $OUT); with PROFILE_PYSPY=1 and a
#   py-spy wheel carried in .whl/, the profile runs under `py-spy record --subprocesses` (daemon
#   included), its collapsed stacks in $OUT/pyspy.txt.gz.
#   (7) with PROFILE_WAIT_BASELINE=1, the profile runs again with --wait-each-step (each step waited
#   for before its token is picked: the baseline of decoding one token ahead) into profile-wait.json.
#   PROFILE_BASELINE_ARGS="--no-dense-kernels" runs it again with those flags into profile-baseline.json.
#   GPU_HOTPATH_PROFILE_BASELINE_TREE=DIR (an older tree extracted in the working tree) runs the profile
#   again over DIR's code into profile-tree-baseline.json, with --modes $GPU_HOTPATH_PROFILE_BASELINE_MODES
#   when set (a later --modes overrides PROFILE_ARGS's): old against new within one call.
#   (8) bench/dense_kernels.py (the decode step's GEMV, attention and router kernels against torch's,
#   --sweep of the GEMV's launch shapes) into dense_kernels.json, before the profile; before it
#   (9) bench/gemv_sweep.py (the experts' GEMV and grouped GEMM per launch shape, types
#   $GPU_HOTPATH_GEMV_TYPES, default Q4_K MXFP4, more arguments in $GPU_HOTPATH_GEMV_ARGS, e.g.
#   "--no-gemv --gemm-tokens 64 512 2048") into gemv_sweep.json; with GPU_HOTPATH_GEMV_BASELINE=DIR
#   (an older tree extracted in the working tree, e.g. `mkdir base && git archive REV | tar -x -C base`),
#   the same sweep over DIR's kernels into gemv_sweep-baseline.json: the ratio within one call.
#   A *_S of 0 skips that part (GPU_HOTPATH_TESTS_S=0: no tests; GPU_HOTPATH_CPU_S=0: no CPU kernels
#   bench; GPU_HOTPATH_GEMV_S=0: no experts sweep; GPU_HOTPATH_PROFILE_S=0: no profile, nor its baselines).
#   OUT=/some/dir PROFILE_ARGS="--layers 12 --tokens 64" scripts/gpu_hotpath.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_hotpath}
mkdir -p "$OUT/logs"
SITE=/tmp/site
failed=0
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        > "$OUT/logs/install.log" 2>&1 || failed=1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} > "$OUT/logs/machine.txt" 2>&1

LLAMA_BIN=""
if [[ -f .llamacpp/llama.cpp-src.tar.gz || -d .llamacpp/pack ]]; then
    # Binaries carried in .llamacpp/pack are only reassembled; a fresh build is packed into
    # $OUT/llamacpp for the next call to carry.
    PACK_OUT=(--out "$OUT/llamacpp"); [[ -f .llamacpp/pack/REASSEMBLE.txt ]] && PACK_OUT=()
    (nice -n 10 bench/llamacpp/build.sh --jobs "${GPU_HOTPATH_LLAMA_JOBS:-10}" "${PACK_OUT[@]}" \
        > "$OUT/logs/llamacpp-build.log" 2>&1; echo $? > /tmp/llamacpp-build.rc) &
    LLAMA_PID=$!
fi

if [[ "${GPU_HOTPATH_TESTS_S:-200}" != 0 ]]; then
echo "=== GPU tests of the fast path"
# tests/inference's conftest imports the server fixtures, which import openai: the GPU image has none
python3 -c "import openai" 2>/dev/null || echo "GPU tests: openai is not importable; carry it and its dependencies in .whl/" \
    "(pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl openai)"
timeout --kill-after=10 "${GPU_HOTPATH_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    ${GPU_HOTPATH_TESTS:-tests/inference/test_fused_experts.py tests/inference/test_dense_kernels.py tests/inference/test_decode_graph.py tests/inference/test_piecewise.py \
    tests/storaged/test_device_cuda.py tests/storaged/test_server_cuda.py \
    tests/inference/test_exactness.py::test_bfloat16_model_matches_from_pretrained_eager \
    tests/inference/test_engine_batch.py::test_a_batch_runs_on_cuda_with_one_acquire_per_layer_and_step} \
    2>&1 | tee "$OUT/logs/gpu_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}
# pytest's 5: nothing collected or everything deselected (e.g. a -k inside GPU_HOTPATH_TESTS)
((tests_rc == 5)) && echo "GPU tests: none ran; GPU_HOTPATH_TESTS selects no test (paths and node ids only)"
((tests_rc != 0)) && failed=1
fi

if [[ -n "${LLAMA_PID:-}" ]]; then
    echo "=== waiting for the llama.cpp build"
    wait "$LLAMA_PID"
    if [[ "$(cat /tmp/llamacpp-build.rc 2>/dev/null)" == 0 ]]; then LLAMA_BIN=.llamacpp/bin/llama-bench; else
        echo "llama.cpp build failed: $(tail -5 "$OUT/logs/llamacpp-build.log")"; failed=1; fi
fi

if [[ "${GPU_HOTPATH_COVERAGE:-0}" == 1 ]]; then
    echo "=== bf16 CUDA coverage"
    timeout --kill-after=10 "${GPU_HOTPATH_COVERAGE_S:-240}" python3 scripts/moe_coverage.py --device cuda ${GPU_HOTPATH_COVERAGE_TYPES:+--types $GPU_HOTPATH_COVERAGE_TYPES} \
        > "$OUT/logs/coverage.log" 2>&1 || failed=1
    tail -5 "$OUT/logs/coverage.log"; cp docs/moe_coverage.json "$OUT/moe_coverage.json"
fi

if [[ "${GPU_HOTPATH_CPU_S:-120}" != 0 ]]; then
echo "=== CPU experts kernels"
timeout --kill-after=10 "${GPU_HOTPATH_CPU_S:-120}" python3 bench/host_experts_bench.py --threads ${GPU_HOTPATH_CPU_THREADS:-1 12} \
    ${GPU_HOTPATH_CPU_BASELINE:+--baseline "$GPU_HOTPATH_CPU_BASELINE"} --json "$OUT/host_experts_bench.json" 2>&1 \
    | tee "$OUT/logs/host_experts_bench.log" | tail -8
((PIPESTATUS[0] != 0)) && failed=1
fi

if [[ "${GPU_HOTPATH_GEMV_S:-120}" != 0 ]]; then
echo "=== experts GEMV and grouped GEMM launch shapes"
timeout --kill-after=10 "${GPU_HOTPATH_GEMV_S:-120}" python3 bench/gemv_sweep.py --types ${GPU_HOTPATH_GEMV_TYPES:-Q4_K MXFP4} \
    ${GPU_HOTPATH_GEMV_ARGS:-} --json "$OUT/gemv_sweep.json" 2>&1 | tee "$OUT/logs/gemv_sweep.log" | grep -E "GEMV|GEMM|best|shipped"
((PIPESTATUS[0] != 0)) && failed=1
if [[ -n "${GPU_HOTPATH_GEMV_BASELINE:-}" ]]; then
    # the same sweep (this tree's script) over the kernels of an older tree carried beside this one
    echo "=== the same sweep over the kernels of $GPU_HOTPATH_GEMV_BASELINE"
    cp bench/gemv_sweep.py "$GPU_HOTPATH_GEMV_BASELINE/bench/gemv_sweep.py"
    (cd "$GPU_HOTPATH_GEMV_BASELINE" && PYTHONPATH="$SITE:$PWD" timeout --kill-after=10 "${GPU_HOTPATH_GEMV_S:-120}" \
        python3 bench/gemv_sweep.py --types ${GPU_HOTPATH_GEMV_TYPES:-Q4_K MXFP4} ${GPU_HOTPATH_GEMV_ARGS:-} \
        --json "$OUT/gemv_sweep-baseline.json") 2>&1 | tee "$OUT/logs/gemv_sweep-baseline.log" | grep -E "GEMV|GEMM|best|shipped"
    ((PIPESTATUS[0] != 0)) && failed=1
fi
fi

if [[ "${GPU_HOTPATH_DENSE_S:-150}" != 0 ]]; then
echo "=== dense kernels"
timeout --kill-after=10 "${GPU_HOTPATH_DENSE_S:-150}" python3 bench/dense_kernels.py ${GPU_HOTPATH_DENSE_ARGS:---sweep} \
    --json "$OUT/dense_kernels.json" 2>&1 | tee "$OUT/logs/dense_kernels.log" | tail -30
((PIPESTATUS[0] != 0)) && failed=1
fi

if [[ "${GPU_HOTPATH_PROFILE_S:-300}" != 0 ]]; then
echo "=== profile"
WRAP=()
if [[ "${PROFILE_PYSPY:-0}" == 1 ]]; then
    WRAP=("$SITE/bin/py-spy" record --subprocesses --nonblocking --rate "${PROFILE_PYSPY_RATE:-100}" --format raw -o /tmp/pyspy.txt --)
fi
timeout --kill-after=10 "${GPU_HOTPATH_PROFILE_S:-300}" "${WRAP[@]}" python3 bench/layer_profile.py --device cuda \
    --out "$OUT/profile.json" ${LLAMA_BIN:+--llamacpp-bin "$LLAMA_BIN"} ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/logs/profile.log" | tail -20
((PIPESTATUS[0] != 0)) && failed=1
if [[ "${PROFILE_WAIT_BASELINE:-0}" == 1 ]]; then
    echo "=== profile, each step waited for (--wait-each-step)"
    timeout --kill-after=10 "${GPU_HOTPATH_PROFILE_S:-300}" python3 bench/layer_profile.py --device cuda --wait-each-step \
        --out "$OUT/profile-wait.json" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/logs/profile-wait.log" | tail -20
    ((PIPESTATUS[0] != 0)) && failed=1
fi
if [[ -n "${PROFILE_BASELINE_ARGS:-}" ]]; then
    echo "=== profile, baseline ($PROFILE_BASELINE_ARGS)"
    timeout --kill-after=10 "${GPU_HOTPATH_PROFILE_S:-300}" python3 bench/layer_profile.py --device cuda $PROFILE_BASELINE_ARGS \
        --out "$OUT/profile-baseline.json" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/logs/profile-baseline.log" | tail -20
    ((PIPESTATUS[0] != 0)) && failed=1
fi
if [[ -n "${GPU_HOTPATH_PROFILE_BASELINE_TREE:-}" ]]; then
    # The same profile over an older tree's code, reusing the GGUF and pack that the first profile
    # wrote to the same --workdir; _MODES can leave out llamacpp, which no tree changes.
    echo "=== profile over the code of $GPU_HOTPATH_PROFILE_BASELINE_TREE"
    (cd "$GPU_HOTPATH_PROFILE_BASELINE_TREE" && PYTHONPATH="$SITE:$PWD" timeout --kill-after=10 "${GPU_HOTPATH_PROFILE_S:-300}" \
        python3 bench/layer_profile.py --device cuda --out "$OUT/profile-tree-baseline.json" ${PROFILE_ARGS:-} \
        ${GPU_HOTPATH_PROFILE_BASELINE_MODES:+--modes $GPU_HOTPATH_PROFILE_BASELINE_MODES}) 2>&1 \
        | tee "$OUT/logs/profile-tree-baseline.log" | tail -20
    ((PIPESTATUS[0] != 0)) && failed=1
fi
fi
[[ -f /tmp/pyspy.txt ]] && gzip -c /tmp/pyspy.txt > "$OUT/pyspy.txt.gz"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $failed
