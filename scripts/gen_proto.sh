#!/usr/bin/env bash
# Regenerate storaged/_proto from proto/ (or, with --check, fail if it is stale). See gen_proto.py.
# Runs with the project's .venv (scripts/bootstrap.sh) when there is one, else $PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python="${PYTHON:-python3}"; fi
exec "$python" scripts/gen_proto.py "$@"
