#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite once per Keras backend
# (jax, torch, tensorflow). Fails if any backend's run fails.
#
# Extra arguments go to every pytest run, e.g. the fast edit-test subset:
#   bash scripts/test.sh -m "not slow"
# Environment:
#   TEST_BACKENDS  backends to run (default "jax torch tensorflow")
#   TEST_JOBS      pytest runs at the same time (default: CPU count, at most 3).
#                  TEST_JOBS=1 runs each backend's suite in one run, one backend after
#                  another, at the default thread counts, and streams the output live.
#   TEST_PLAN=1    prints the runs it would start (backend, estimated seconds, pytest
#                  arguments) and the estimated end of each slot, and exits; sets up nothing.
# With TEST_JOBS > 1 each backend's suite runs in parts (PARTS below): the files a part
# names, and the rest of that backend's suite (the other parts' files --ignore'd), so every
# test still runs once per backend. The parts start longest first, each as soon as a run
# ends, so the runs end close together; each part's log is printed when it ends. Each run
# then has OMP_NUM_THREADS=1 (torch's intra-op threads, the BLAS; a value the caller
# sets wins): the runs already fill the cores, and torch's second thread mostly spins
# (a torch file's user + sys CPU time fell from 36-46 s to 27-28 s on a loaded 2-core
# machine). Arguments that name tests (a path) run each backend's suite in one run instead.
set -uo pipefail
cd "$(dirname "$0")/.."
backends=(${TEST_BACKENDS:-jax torch tensorflow})
cores=$(nproc 2>/dev/null || echo 1)
jobs=${TEST_JOBS:-$(( cores < 3 ? cores : 3 ))}
pytest_args=(-q --durations=25 "$@")
status=0

# backend, seconds its run took beside another on 2 cores (from --durations; only the
# start order and TEST_PLAN's estimate use it), the files of the part; a part without
# files: the rest of that backend's suite. The jax suite is split so that the two slots
# end close together; each extra run costs a start (imports, collection).
PARTS=(
  "torch       1300"
  "jax         1100"
  "jax          840  tests/cutbce/test_tpu_compile.py tests/examples/test_examples.py tests/cutbce/test_pallas.py tests/cutbce/test_cut_bce.py tests/cutbce/test_chunked.py"
  "tensorflow   690"
  "tensorflow    45  tests/test_readme.py"
)

names_tests=0
for arg in "$@"; do
  [ -e "${arg%%::*}" ] && names_tests=1
done

parts=()  # "backend<TAB>seconds<TAB>label<TAB>pytest arguments", longest first
if [ "$jobs" -gt 1 ] && [ "$names_tests" = 0 ]; then
  while read -r backend seconds files; do
    [[ " ${backends[*]} " == *" $backend "* ]] || continue
    if [ -n "$files" ]; then
      existing=()
      for f in $files; do [ -e "$f" ] && existing+=("$f"); done
      [ "${#existing[@]}" -gt 0 ] && parts+=("$backend"$'\t'"$seconds"$'\t'"${existing[*]}"$'\t'"${existing[*]}")
    else
      ignores=()
      for spec in "${PARTS[@]}"; do
        read -r other _ others <<<"$spec"
        [ "$other" = "$backend" ] || continue
        for f in $others; do ignores+=("--ignore=$f"); done
      done
      parts+=("$backend"$'\t'"$seconds"$'\t'"the rest"$'\t'"${ignores[*]}")
    fi
  done < <(printf '%s\n' "${PARTS[@]}" | sort -k2,2nr -s)
  for backend in "${backends[@]}"; do  # a backend PARTS does not name: its suite in one run
    printf '%s\n' "${PARTS[@]}" | grep -q "^$backend " || parts+=("$backend"$'\t'"0"$'\t'"all"$'\t')
  done
else
  for backend in "${backends[@]}"; do parts+=("$backend"$'\t'"0"$'\t'"all"$'\t'); done
fi

if [ -n "${TEST_PLAN:-}" ]; then
  # the runs in the order they start, then each slot's estimated end (longest first, each
  # run on the slot that frees first)
  printf '%s\n' "${parts[@]}" | awk -F'\t' -v slots="$jobs" -v args="${pytest_args[*]}" '
    { printf "KERAS_BACKEND=%s ~%ss: pytest %s %s\n", $1, $2, args, $4
      best = 0; for (i = 1; i < slots; i++) if (end[i] < end[best]) best = i
      end[best] += $2 }
    END { for (i = 0; i < slots; i++) printf "slot %d ends at ~%d s\n", i + 1, end[i] }'
  exit 0
fi

bash scripts/setup_env.sh || exit 1

if [ "$jobs" -le 1 ]; then
  for backend in "${backends[@]}"; do
    echo "=== KERAS_BACKEND=$backend ==="
    KERAS_BACKEND=$backend .venv/bin/python -m pytest "${pytest_args[@]}" || status=1
  done
else
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one intra-op thread per run (above)
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  declare -A pids=() labels=() started=() ran=()
  report() {  # prints the log of the finished part $1 and records its status
    local rc
    echo "=== KERAS_BACKEND=${labels[$1]} ($(( SECONDS - started[$1] )) s) ==="
    cat "$logs/$1.log"
    rc=$(cat "$logs/$1.rc" 2>/dev/null)
    # 5: the part selected no test (say, -k or -m matched none of its files); a backend
    # fails when none of its parts ran a test
    if [ "$rc" != 5 ]; then
      ran[${labels[$1]%% *}]=1
      [ "$rc" = 0 ] || status=1
    fi
  }
  wait_one() {  # waits for a running part to finish, then reports every finished one
    local done_part
    wait -n 2>/dev/null
    for done_part in "${!pids[@]}"; do
      if ! kill -0 "${pids[$done_part]}" 2>/dev/null; then
        report "$done_part"
        unset "pids[$done_part]"
      fi
    done
  }
  n=0
  for part in "${parts[@]}"; do
    IFS=$'\t' read -r backend _ label part_args <<<"$part"
    n=$((n + 1))
    while [ "${#pids[@]}" -ge "$jobs" ]; do wait_one; done
    labels[$n]="$backend ($label)"
    started[$n]=$SECONDS
    (
      # Its own temporary folder: two pytest sessions never clean up each other's.
      # shellcheck disable=SC2086  # part_args: file names and --ignore options, no spaces
      KERAS_BACKEND=$backend .venv/bin/python -m pytest --basetemp="$logs/tmp-$n" \
        "${pytest_args[@]}" $part_args >"$logs/$n.log" 2>&1
      echo $? >"$logs/$n.rc"
    ) &
    pids[$n]=$!
    echo "started KERAS_BACKEND=${labels[$n]} (log printed when it ends)"
  done
  while [ "${#pids[@]}" -gt 0 ]; do wait_one; done
  for backend in "${backends[@]}"; do
    [ -n "${ran[$backend]:-}" ] || { echo "KERAS_BACKEND=$backend: no part ran a test"; status=1; }
  done
  echo "all runs ended after $SECONDS s"
fi
if [ $status -ne 0 ]; then echo "FAILED on at least one backend"; fi
exit $status
