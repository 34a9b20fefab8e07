#!/usr/bin/env bash
# Install everything into .venv and run the whole test suite, slow tests included (GPU tests skip
# without CUDA). Plain `pytest` deselects the slow ones (pyproject.toml's addopts); the -m below
# selects every test, and a -m among the arguments comes after it and wins.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/gen_proto.sh --check
exec .venv/bin/python -m pytest -q -m "slow or not slow" "$@"
