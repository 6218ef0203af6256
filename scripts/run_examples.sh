#!/usr/bin/env bash
# Sets up .venv and runs the project's main job on its built-in default data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m examples.run_all "$@"
