#!/usr/bin/env bash
# The whole benchmark suite in one device call (<= 9 minutes, set-up included), from the repository root:
#   (1) install the carried wheels (.whl/) into /tmp/site, as scripts/gpu_checks.sh does;
#   (2) machine limits and storaged alone: bench/storaged_bench.py (raw O_DIRECT GB/s at queue depths
#       1/4/16, pinned H2D GB/s, storaged miss-path GB/s and its ratio to raw, acquire p50/p99);
#   (3) the end-to-end matrix, bench/e2e/main.py, in what is left of the budget (tokens cut short for
#       slow contenders, stated per run).
# Writes $OUT/results.json and $OUT/results.md (plus logs). Exit status non-zero if a step failed.
#
#   OUT=/some/dir bench/run_all.sh            RUN_ALL_BUDGET_S=540 caps the total
#   RUN_ALL_E2E_ARGS="--shapes qwen3 --layers 16" RUN_ALL_MACHINE_JSON=earlier/storaged_bench.json bench/run_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/run_all}
mkdir -p "$OUT"
BUDGET_S=${RUN_ALL_BUDGET_S:-540}
MACHINE_CAP_S=${RUN_ALL_MACHINE_S:-100}
DEVICE=${RUN_ALL_DEVICE:-cuda}
WORKDIR=${RUN_ALL_WORKDIR:-/var/tmp/expertpack-e2e}
SITE=/tmp/site
failed=0

started=$SECONDS
{ date -u +%FT%TZ; uname -a; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nproc; free -g | sed -n 2p; df -h "$(dirname "$WORKDIR")" | tail -1
  # a snapshot (git archive) has no .git of its own: its COMMIT file names what it was made from
  if [[ -f COMMIT ]]; then echo "commit $(cat COMMIT)"; else echo "commit $(git rev-parse HEAD 2>/dev/null)"; fi
} > "$OUT/machine.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        2>&1 | tee "$OUT/install.log" || failed=1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import sys, torch, transformers, grpc, google.protobuf as pb, gguf
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__,
      'gguf', __import__('importlib.metadata').metadata.version('gguf'))" >> "$OUT/machine.txt" 2>&1
echo "=== install: $((SECONDS - started)) s"

# (2) machine limits + storaged alone: a 4 GiB pack of 13 MiB objects, 3 s per throughput run;
#     RUN_ALL_MACHINE_JSON=file reuses an earlier run's figures (one shape per call, same machine kind)
if [[ -n "${RUN_ALL_MACHINE_JSON:-}" ]]; then
    cp "$RUN_ALL_MACHINE_JSON" "$OUT/storaged_bench.json"
    echo "=== machine limits and storaged alone: reused $RUN_ALL_MACHINE_JSON"
else
    limit=$((MACHINE_CAP_S < BUDGET_S - SECONDS ? MACHINE_CAP_S : BUDGET_S - SECONDS))
    timeout --kill-after=10 "$limit" python3 bench/storaged_bench.py --device "$DEVICE" --pack-gib "${RUN_ALL_PACK_GIB:-4}" \
        --seconds "${RUN_ALL_RAW_SECONDS:-3}" --hit-acquires 1000 --json "$OUT/storaged_bench.json" \
        2>&1 | tee "$OUT/storaged_bench.log"
    ((PIPESTATUS[0] != 0)) && failed=1
    echo "=== machine limits and storaged alone: done at $SECONDS s"
fi

# (3) the e2e matrix in the rest, leaving 30 s for shutdown and the report
e2e_seconds=$((BUDGET_S - SECONDS - 30))
if ((e2e_seconds < 60)); then
    echo "only ${e2e_seconds} s left for the e2e matrix: skipped" | tee -a "$OUT/e2e.log"
    failed=1
else
    timeout --kill-after=15 $((e2e_seconds + 20)) python3 -m bench.e2e.main --device "$DEVICE" --out "$OUT" \
        --workdir "$WORKDIR" --seconds "$e2e_seconds" --machine-json "$OUT/storaged_bench.json" \
        ${RUN_ALL_E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log"
    ((PIPESTATUS[0] != 0)) && failed=1
fi
# one archive: the device tool brings back at most 8 files
# (logs only: runs/ also holds accelerate's offload folder, gigabytes)
(cd "$WORKDIR/runs" 2>/dev/null && tar czf "$OUT/run-logs.tgz" ./*.log)
echo "=== total $SECONDS s; results in $OUT/results.json and $OUT/results.md"
exit $failed
