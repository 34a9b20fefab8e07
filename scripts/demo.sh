#!/usr/bin/env bash
# The main job end to end on a small built-in model:
#   install (.venv) -> synth a qwen3_moe GGUF with Q4_K experts -> build its bundle -> start storaged
#   -> start `inference serve --storaged` -> one chat request with the openai client -> print the
#   answer, storaged's cache figures and the inference metrics -> stop both (on failure and Ctrl-C too).
# Runs on the GPU (storaged and inference on cuda) when torch sees one, on the CPU otherwise.
#
# Environment:
#   DEMO_DIR                     where the model and its bundle go (default: ./demo, replaced each run)
#   EXPERTPACK_SKIP_BOOTSTRAP=1  install nothing; run with PYTHON (required then), e.g. CI's interpreter
#   PYTHON                       with bootstrap: the interpreter .venv is made from (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
if [ "${EXPERTPACK_SKIP_BOOTSTRAP:-0}" = 1 ]; then
  PY=${PYTHON:?EXPERTPACK_SKIP_BOOTSTRAP=1 needs PYTHON=/path/to/python}
else
  scripts/bootstrap.sh
  PY=$REPO/.venv/bin/python
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's packages, whatever PY has installed
export PYTHONUNBUFFERED=1
OUT=$(mkdir -p "${DEMO_DIR:-demo}" && cd "${DEMO_DIR:-demo}" && pwd)
MODEL=qwen3-moe-demo  # the bundle directory's name: inference's default --storaged-model
BUNDLE=$OUT/$MODEL
RUN=$(mktemp -d "${TMPDIR:-/tmp}/expertpack-demo.XXXXXX")  # socket and logs; short, for the socket path
STORAGED_PID=
INFERENCE_PID=

alive() {  # a child that exited stays a zombie until reaped: not alive
  [ -r "/proc/$1/status" ] && ! grep -qs '^State:.*zombie' "/proc/$1/status"
}

stop() {  # SIGTERM, SIGKILL after 30 s, and reap
  local pid=$1 tenths=0
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  while alive "$pid" && [ "$tenths" -lt 300 ]; do sleep 0.1; tenths=$((tenths + 1)); done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

exec 3>&1 4>&2  # the script's own stdout and stderr, for cleanup's messages
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  exec 1>&3 2>&4  # a signal may arrive while a command's output is redirected (wait_until's probes)
  stop "$INFERENCE_PID"  # first: its session ends cleanly while storaged still listens
  stop "$STORAGED_PID"
  if [ "$status" != 0 ]; then
    for log in "$RUN"/*.log; do
      [ -s "$log" ] && { echo "--- $(basename "$log") (last lines)"; tail -n 20 "$log"; }
    done
    echo "demo: FAILED (status $status)"
  fi
  rm -rf "$RUN"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() { echo "== [${SECONDS}s] $*"; }

wait_until() {  # wait_until WHAT PID SECONDS COMMAND...: poll COMMAND; give up when PID dies or time runs out
  local what=$1 pid=$2 limit=$3 deadline=$((SECONDS + $3))
  shift 3
  until "$@" >/dev/null 2>&1; do
    alive "$pid" || { echo "demo: $what exited during start-up"; return 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "demo: $what not ready after $limit s"; return 1; }
    sleep 0.2
  done
}

step "synth: a random qwen3_moe model, GGUF with Q4_K experts, hidden 256 (in $OUT)"
rm -rf "$OUT/model.gguf" "$BUNDLE"
"$PY" -m packtools.cli synth qwen3_moe -o "$OUT/model.gguf" --format gguf --expert-type Q4_K --hidden-size 256 --seed 0
step "build: its pack bundle"
"$PY" -m packtools.cli build "$OUT/model.gguf" -o "$BUNDLE" --quiet
"$PY" -m packtools.cli validate "$BUNDLE" --full
"$PY" -m packtools.cli inspect "$BUNDLE"

if [ "$("$PY" -c 'import torch; print(torch.cuda.is_available())')" = True ]; then
  STORAGED_DEVICE=cuda:0 INFERENCE_DEVICE=cuda DTYPE=bfloat16
else
  STORAGED_DEVICE=cpu INFERENCE_DEVICE=cpu DTYPE=float32  # float32 matmuls are the fast ones on a CPU
fi
# O_DIRECT needs a filesystem that supports it (tmpfs and some overlays do not): try one aligned read.
DIRECT_READ='import mmap, os, sys; os.preadv(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT), [mmap.mmap(-1, 4096)], 0)'
if "$PY" -c "$DIRECT_READ" "$BUNDLE/experts.pack" 2>/dev/null; then
  DIRECT_IO=--direct-io
else
  DIRECT_IO=--no-direct-io
  echo "note: the filesystem of $OUT does not support O_DIRECT; storaged reads through the page cache"
fi
METRICS_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SOCKET=$RUN/storaged.sock

step "storaged on $SOCKET (device $STORAGED_DEVICE, $DIRECT_IO, metrics http://127.0.0.1:$METRICS_PORT/metrics)"
"$PY" -m storaged --model "$MODEL=$BUNDLE" --socket "$SOCKET" --device "$STORAGED_DEVICE" --vram-cache-bytes 64MiB \
  --metrics-address "127.0.0.1:$METRICS_PORT" "$DIRECT_IO" >"$RUN/storaged.log" 2>&1 &
STORAGED_PID=$!
echo "storaged pid $STORAGED_PID"
wait_until storaged "$STORAGED_PID" 120 test -S "$SOCKET"
"$PY" -c 'import sys; from storaged.client import StorageClient as C; C(sys.argv[1]).wait_until_serving(60)' "$SOCKET"

step "inference serve --storaged $SOCKET (device $INFERENCE_DEVICE, $DTYPE)"
"$PY" -m inference serve --bundle "$BUNDLE" --storaged "$SOCKET" --device "$INFERENCE_DEVICE" --dtype "$DTYPE" \
  --host 127.0.0.1 --port 0 >"$RUN/inference.log" 2>&1 &
INFERENCE_PID=$!
echo "inference pid $INFERENCE_PID"
listening() { grep -o "serving '[^']*' on http://[^ ]*" "$RUN/inference.log"; }
wait_until inference "$INFERENCE_PID" 300 listening
URL=$(listening | head -n 1 | sed 's/.* on //')
healthy() { "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)' "$URL"; }
wait_until inference "$INFERENCE_PID" 300 healthy
step "inference ready on $URL"

step "chat request (openai client)"
"$PY" scripts/demo_client.py --base-url "$URL" --model "$MODEL" --storaged-socket "$SOCKET" \
  --storaged-metrics-url "http://127.0.0.1:$METRICS_PORT/metrics"
step "stopping"
