#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite once per Keras backend
# (jax, torch, tensorflow). Fails if any backend's run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
status=0
for backend in jax torch tensorflow; do
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND=$backend .venv/bin/python -m pytest -q "$@" || status=1
done
if [ $status -ne 0 ]; then echo "FAILED on at least one backend"; fi
exit $status
