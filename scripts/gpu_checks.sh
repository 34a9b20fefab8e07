#!/usr/bin/env bash
# Everything the lent GPU machine has to tell us, in one command (run from the repository root):
#   (a) install the carried wheels (.whl/) into /tmp/site, (b) print versions and nvidia-smi,
#   (c) the GPU-marked tests, (d) bench/storaged_bench.py, (e) bench/dequant_bench.py,
#   (f) a summary. A failed step does not stop the others; the exit status is non-zero if any
#   failed. Logs and JSON land in $OUT (default /tmp/gpu_checks). Whole run: about 5 minutes.
#
#   OUT=/some/dir scripts/gpu_checks.sh
#   GPU_CHECKS_BUDGET_S=300 caps the total; each step also has its own cap (below).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
BUDGET_S=${GPU_CHECKS_BUDGET_S:-300}
TESTS_CAP_S=${GPU_CHECKS_TESTS_S:-120}
STORAGED_BENCH_CAP_S=${GPU_CHECKS_STORAGED_BENCH_S:-150}
DEQUANT_BENCH_CAP_S=${GPU_CHECKS_DEQUANT_BENCH_S:-75}
SITE=/tmp/site

declare -a STEP_NAMES=() STEP_CODES=() STEP_SECONDS=()

record() {  # name rc seconds
    STEP_NAMES+=("$1"); STEP_CODES+=("$2"); STEP_SECONDS+=("$3")
    echo "=== step $1: exit $2 after $3 s"
}

# run_step NAME CAP_S CMD...: runs CMD under a time limit (the smaller of CAP_S and what is left of
# the budget, at least 10 s), output to the terminal and $OUT/NAME.log.
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - SECONDS))
    local limit=$((cap < left ? cap : left))
    ((limit < 10)) && limit=10
    echo "=== step $name (limit ${limit} s): $*"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    ((rc == 124)) && echo "=== step $name: TIMED OUT after ${limit} s"
    record "$name" "$rc" $((SECONDS - started))
}

# (a) wheels the image lacks (gguf, grpcio health checking and reflection)
started=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    2>&1 | tee "$OUT/install.log"
record install "${PIPESTATUS[0]}" $((SECONDS - started))
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# (b) what this machine is
run_step versions 60 bash -c '
    python3 --version; nproc; free -g | head -2; df -h /var/tmp /tmp | cat
    python3 -c "
import importlib, torch
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())
if torch.cuda.is_available():
    print(\"device\", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in (\"transformers\", \"triton\", \"grpc\", \"google.protobuf\", \"gguf\", \"numpy\", \"safetensors\",
             \"hypothesis\", \"aiohttp\", \"uvloop\", \"prometheus_client\"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, \"__version__\", \"?\"), getattr(module, \"__file__\", \"\"))
    except ImportError as exc:
        print(name, \"MISSING:\", exc)
"
    nvidia-smi'

# (c) GPU-marked tests. Test files importing a module this image lacks (e.g. openai) cannot even be
# collected: leave them out, with the files that import them, and say so.
declare -A IGNORED=()
for module in openai hypothesis grpc_tools; do
    python3 -c "import $module" 2>/dev/null && continue
    while read -r file; do IGNORED[$file]=$module; done < <(grep -rlE "^(import|from) $module([ .]|$)" tests --include='*.py')
done
changed=1
while ((changed)); do  # helpers such as test_server_fixtures.py spread a missing import to their users
    changed=0
    for file in "${!IGNORED[@]}"; do
        helper=$(basename "$file" .py)
        while read -r user; do
            [[ -n ${IGNORED[$user]:-} ]] && continue
            IGNORED[$user]="${IGNORED[$file]} (via $helper)"; changed=1
        done < <(grep -rlE "^(import|from) $helper( |$)" tests --include='*.py')
    done
done
PYTEST_ARGS=(-q -m gpu --continue-on-collection-errors -p no:cacheprovider)
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout=110)
for file in "${!IGNORED[@]}"; do
    echo "leaving out $file: needs ${IGNORED[$file]}, not installed here"
    PYTEST_ARGS+=("--ignore=$file")
done
run_step gpu_tests "$TESTS_CAP_S" python3 -m pytest "${PYTEST_ARGS[@]}" tests/

# (c2) the fault suite against a CUDA arena (its quick sizes; docs/reliability.md)
run_step reliability_cuda "${RELIABILITY_CAP_S:-240}" env EXPERTPACK_RELIABILITY_DEVICE=cuda:0 \
    EXPERTPACK_RELIABILITY_FIGURES="$OUT/reliability-cuda.json" python3 -m pytest -q -p no:cacheprovider \
    tests/reliability -m "not slow" -k "kills or stress or corrupt or restart or fault"

# (d) storaged against raw O_DIRECT, and the hit round trip
run_step storaged_bench "$STORAGED_BENCH_CAP_S" python3 bench/storaged_bench.py --device cuda \
    --json "$OUT/storaged_bench.json"
bench_dir=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['context']['dir'])" \
    "$OUT/storaged_bench.json" 2>/dev/null) && cp "$bench_dir"/storaged-*.log "$OUT/" 2>/dev/null

# (e) dequantization kernels against the copy roofline
run_step dequant_bench "$DEQUANT_BENCH_CAP_S" python3 bench/dequant_bench.py

# (f) summary
echo
echo "==================== summary ($SECONDS s) ===================="
failed=0
for i in "${!STEP_NAMES[@]}"; do
    printf '%-16s exit %-4s %5s s\n' "${STEP_NAMES[$i]}" "${STEP_CODES[$i]}" "${STEP_SECONDS[$i]}"
    ((STEP_CODES[i] != 0)) && failed=1
done
echo "tests: $(grep -E '(passed|failed|error|skipped|deselected)' "$OUT/gpu_tests.log" 2>/dev/null | tail -1)"
if [[ -f $OUT/storaged_bench.json ]]; then
    python3 -c "
import json, sys
results = json.load(open(sys.argv[1]))
for key, value in (results.get('figures') or {}).items():
    print(f'{key:28s} {value}')
for line in results.get('warnings', []) + results.get('errors', []):
    print('!', line)
" "$OUT/storaged_bench.json"
fi
((failed)) && echo "SOME STEPS FAILED" || echo "ALL STEPS PASSED"
exit $failed
