#!/usr/bin/env bash
# The whole benchmark suite in one device call (<= 9 minutes, set-up included), from the repository root:
#   (1) install the carried wheels (.whl/) into /tmp/site, as scripts/gpu_checks.sh does;
#   (2) machine limits and storaged alone: bench/storaged_bench.py (raw O_DIRECT GB/s at queue depths
#       1/4/16, pinned H2D GB/s, storaged miss-path GB/s and its ratio to raw, acquire p50/p99);
#   (3) the end-to-end matrix, bench/e2e/main.py, in what is left of the budget (tokens cut short for
#       slow contenders, stated per run).
# When the llamacpp contender is selected (the default), bench/llamacpp/build.sh starts right after (1),
# in the background at nice 19 (RUN_ALL_LLAMACPP_JOBS jobs, default 8 of the cores): it reuses a carried
# .llamacpp/bin or .llamacpp/pack, else builds .llamacpp/llama.cpp-src.tar.gz (~5 minutes on 16 cores;
# the first contenders run meanwhile, and bench/e2e waits for it before the llamacpp contender).
# bench/e2e pauses the build (SIGSTOP to its session) while it times a contender, since compilers
# slowed the disk-bound budgets by 10-30%; the build then ends later, so carrying the binaries is
# still the better way: RUN_ALL_LLAMACPP_OUT=dir writes them there, compressed and split, for
# .llamacpp/pack next time. A run timed while the build compiled anyway is marked (note, warning).
# A missing or failed llama-bench is an error of the run (RUN_ALL_REQUIRE_LLAMACPP=0: a skipped contender).
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

# llama.cpp, unless --contenders leaves it out: built in the background while (2) and (3) run
e2e_args=" ${RUN_ALL_E2E_ARGS:-} "
if [[ "$e2e_args" != *" --contenders "* || "$e2e_args" == *" llamacpp "* ]]; then
    mkdir -p "$WORKDIR/runs"
    export EXPERTPACK_LLAMACPP_BUILD_STATUS="$WORKDIR/runs/llamacpp-build.status"
    export EXPERTPACK_LLAMACPP_BUILD_SESSION="$WORKDIR/runs/llamacpp-build.session"
    rm -f "$EXPERTPACK_LLAMACPP_BUILD_STATUS" "$EXPERTPACK_LLAMACPP_BUILD_SESSION"
    export EXPERTPACK_REQUIRE_LLAMACPP=${RUN_ALL_REQUIRE_LLAMACPP:-1}
    llamacpp_args=()
    [[ "$DEVICE" == cpu ]] && llamacpp_args+=(--cpu)
    [[ -n "${RUN_ALL_LLAMACPP_OUT:-}" ]] && llamacpp_args+=(--out "$RUN_ALL_LLAMACPP_OUT")
    # its own session (so the compilers can be stopped with it, and bench/e2e can pause them while
    # it times a contender: the session id is written first); the status file appears only once
    # build.sh has ended: bench/e2e waits for it
    S="$EXPERTPACK_LLAMACPP_BUILD_STATUS" P="$EXPERTPACK_LLAMACPP_BUILD_SESSION" setsid bash -c \
        'echo $$ > "$P"; bench/llamacpp/build.sh "$@" > /dev/null 2>&1; echo $? > "$S.partial"; mv "$S.partial" "$S"' \
        build --nice 19 --jobs "${RUN_ALL_LLAMACPP_JOBS:-8}" --log "$WORKDIR/runs/llamacpp-build.log" \
        "${llamacpp_args[@]}" &
    llamacpp_build=$!
    echo "=== llamacpp: build.sh started in the background (pid $llamacpp_build)"
fi

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
if [[ -n "${llamacpp_build:-}" ]]; then  # never leave it running past the call
    kill -- "-$llamacpp_build" 2>/dev/null && echo "=== llamacpp: build stopped unfinished"
    wait "$llamacpp_build" 2>/dev/null
    [[ "$(cat "$EXPERTPACK_LLAMACPP_BUILD_STATUS" 2>/dev/null)" == 0 ]] || echo "=== llamacpp: build.sh did not succeed (see $WORKDIR/runs/llamacpp-build.log, in run-logs.tgz)"
fi
# one archive: the device tool brings back at most 8 files
# (logs only: runs/ also holds accelerate's offload folder, gigabytes)
(cd "$WORKDIR/runs" 2>/dev/null && tar czf "$OUT/run-logs.tgz" ./*.log)
echo "=== total $SECONDS s; results in $OUT/results.json and $OUT/results.md"
exit $failed
