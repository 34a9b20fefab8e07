#!/usr/bin/env bash
# Create .venv (once) and install expertpack with its test tools into it.
# torch is installed first, pinned, so pip never swaps in a different build behind our back;
# set EXPERTPACK_TORCH to choose another spec (e.g. "torch==2.11.0").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${EXPERTPACK_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
