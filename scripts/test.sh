#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite once per Keras backend
# (jax, torch, tensorflow). Fails if any backend's run fails.
#
# Extra arguments go to every pytest run, e.g. the fast edit-test subset:
#   bash scripts/test.sh -m "not slow"
# Environment:
#   TEST_BACKENDS  backends to run (default "jax torch tensorflow")
#   TEST_JOBS      backends run at the same time (default: CPU count, at most 3);
#                  most tests use one core, so on 2 cores two backends side by side
#                  take about half the time. TEST_JOBS=1 streams the output live.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
backends=(${TEST_BACKENDS:-jax torch tensorflow})
cores=$(nproc 2>/dev/null || echo 1)
jobs=${TEST_JOBS:-$(( cores < 3 ? cores : 3 ))}
pytest_args=(-q --durations=25 "$@")
status=0

if [ "$jobs" -le 1 ]; then
  for backend in "${backends[@]}"; do
    echo "=== KERAS_BACKEND=$backend ==="
    KERAS_BACKEND=$backend .venv/bin/python -m pytest "${pytest_args[@]}" || status=1
  done
else
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  declare -A pids=()
  report() {  # prints the log of the finished backend $1 and records its status
    echo "=== KERAS_BACKEND=$1 ==="
    cat "$logs/$1.log"
    [ "$(cat "$logs/$1.rc" 2>/dev/null)" = 0 ] || status=1
  }
  wait_one() {  # waits for a running backend to finish, then reports every finished one
    local done_backend
    wait -n 2>/dev/null
    for done_backend in "${!pids[@]}"; do
      if ! kill -0 "${pids[$done_backend]}" 2>/dev/null; then
        report "$done_backend"
        unset "pids[$done_backend]"
      fi
    done
  }
  for backend in "${backends[@]}"; do
    while [ "${#pids[@]}" -ge "$jobs" ]; do wait_one; done
    (
      # Its own temporary folder: two pytest sessions never clean up each other's.
      KERAS_BACKEND=$backend .venv/bin/python -m pytest --basetemp="$logs/tmp-$backend" \
        "${pytest_args[@]}" >"$logs/$backend.log" 2>&1
      echo $? >"$logs/$backend.rc"
    ) &
    pids[$backend]=$!
    echo "started KERAS_BACKEND=$backend (log printed when it ends)"
  done
  while [ "${#pids[@]}" -gt 0 ]; do wait_one; done
fi
if [ $status -ne 0 ]; then echo "FAILED on at least one backend"; fi
exit $status
