#!/usr/bin/env bash
# Install everything into .venv and run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/gen_proto.sh --check
exec .venv/bin/python -m pytest -q "$@"
