#!/usr/bin/env bash
# The GPU check: the one command that turns a short window on a CUDA GPU into the project's first GPU
# results (ERASE on torch, then CutBCE's Triton kernels). Built to pass on first contact within
# GPU_CHECK_SECONDS (default 480: 8 minutes) on one H200, on a machine without network whose python3
# already holds torch, Triton and JAX but not Keras (docs/gpu.md, "Offline install").
#
#   scripts/gpu_check.sh --prepare DIR   # where the package index is reachable: the wheels into DIR
#   scripts/gpu_check.sh --wheels DIR    # on the GPU machine, offline: install DIR, then the check
#   scripts/gpu_check.sh                 # the check with $PYTHON (default: .venv's, else python3)
#   scripts/gpu_check.sh --dry-run       # no GPU: the same steps on CPU (nothing is measured)
#   GPU_CHECK_HOST_PYTHON=PY scripts/gpu_check.sh --wheels DIR --dry-run   # the GPU machine's install
#                                        # over PY (its torch, Triton, JAX), then the dry run
#   scripts/gpu_check.sh --wheels DIR --install-only   # install and preflight, then stop
#
# --prepare DIR: keras and the two of its dependencies such a machine lacks (namex, optree), at
#   constraints.txt's pins, the peers the side-by-side runs (cut-cross-entropy 25.1.1, liger-kernel 0.8.5:
#   pure Python, they need only torch and Triton), for CPython GPU_CHECK_PY_VERSION (default 3.12) on
#   x86-64 Linux, and the project as a wheel (about 4 MB in all).
# --wheels DIR: a virtualenv (GPU_CHECK_VENV, default /tmp/gpu_check_venv) over GPU_CHECK_HOST_PYTHON
#   (default python3) that sees its packages (--system-site-packages, and its own site folders when
#   python3 is itself a virtualenv), then `pip install --no-index` of DIR's keras (its other
#   dependencies must already be there: pip names any that is not), of the project and the peers with
#   --no-deps. If no virtualenv can be made, `pip install --target` into GPU_CHECK_VENV/site.
#
# After the install and the preflight (~15 s on the H200: versions, CUDA, a Triton kernel compiled and run),
# ONE priority list (PLAN below, shared with ERASE: issues 48 and 49), each section with its seconds on one
# H200; a section starts only if its seconds fit in what is left of GPU_CHECK_SECONDS (default 480), else
# it is named and skipped (the log's last lines):
#   peers         90  benchmarks/cutbce_triton.py --gpu --sections peers: CutSoftmax / CutBCE beside tuned
#                     dense torch (eager, compiled), CCE, Liger, torch's linear_cross_entropy; bf16, both shapes
#   erase        120  benchmarks/erase_gpu.py --plan device --strict --budget 120: ERASE's device cells
#   erase_tests   60  the ERASE GPU path's tests, one process (TESTS)
#   capture       10  the failing-capture test, its own process
#   cutbce_tests  50  the Triton parity and dispatch tests, compiled (the interpreter on a dry run)
#   matrix        60  the mixed precision matrix (-k policy: ERASE schedules, the CutBCE op, loss, metrics)
#   cutbce_rest   30+ cutbce_triton.py --gpu in what is left: the tile sweeps (kernels, the chunked loop's
#                     CUDA tile), then jit, parity, timings, float16_zeros, mixed_bfloat16, graph_breaks, ncu
# (the machine's start-up is extra). A section that fails is reported and the next one still runs; the exit
# status is 1 if any failed. GPU_CHECK_PLAN=print prints the list and stops.
# Results under benchmarks/results/ (the dry run: GPU_CHECK_OUT, default /tmp/gpu_check_dry_run):
# cutbce_triton_gpu_peers.md / .json / .log, erase_gpu.md / .json, erase_gpu_trace*.json,
# erase_gpu_timeline.png, gpu_check_tests.txt, cutbce_triton_gpu.md / .json / .log,
# gpu_check_cutbce_tests.txt, gpu_check_preflight.txt.
# Environment: PYTHON, GPU_CHECK_SECONDS, GPU_CHECK_OUT, GPU_CHECK_VENV, GPU_CHECK_HOST_PYTHON,
# GPU_CHECK_PY_VERSION, GPU_CHECK_PHASES (default all: a subset of the list's names, `tests` for the three
# test sections, `cutbce` for peers and the two cutbce ones, reruns only those); other arguments go to
# erase_gpu.py.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
START=$SECONDS
DRY=0 PREPARE="" WHEELS="" INSTALL_ONLY=0 BENCH_EXTRA=()
while (( $# )); do
  case "$1" in
    --prepare) PREPARE=${2:?--prepare needs a folder}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    *) BENCH_EXTRA+=("$1"); shift ;;
  esac
done
HOST_PYTHON=${GPU_CHECK_HOST_PYTHON:-python3}
# The one priority list, shared with ERASE (issue 49): NAME SECONDS (the H200 estimate), in order. A section
# that does not fit in what is left of GPU_CHECK_SECONDS is named and skipped (the log's last lines).
PLAN=(peers 90  erase 120  erase_tests 60  capture 10  cutbce_tests 50  matrix 60  cutbce_rest 30)
if [[ ${GPU_CHECK_PLAN:-} == print ]]; then  # the list, nothing run
  printf '%s %s\n' "${PLAN[@]}"; exit 0
fi

# The peers the side-by-side runs (pure Python; torch and Triton are all they need): installed with --no-deps.
PEERS=(cut-cross-entropy==25.1.1 liger-kernel==0.8.5)

pins() {  # constraints.txt's pins of the named distributions
  local name
  for name in "$@"; do grep -i -m1 "^$name==" constraints.txt || { echo "no pin for $name" >&2; return 1; }; done
}

if [[ -n $PREPARE ]]; then  # -- on a machine that reaches the package index ---------------------------
  mkdir -p "$PREPARE"
  PY_VERSION=${GPU_CHECK_PY_VERSION:-3.12}
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
  done
  set -e
  "$HOST_PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$PREPARE" \
    --python-version "$PY_VERSION" --implementation cp "${platforms[@]}" $(pins keras namex optree) "${PEERS[@]}"
  isolation=(--no-build-isolation)  # pyproject.toml needs setuptools >= 77: else pip fetches it
  "$HOST_PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
    2>/dev/null || isolation=()
  "$HOST_PYTHON" -m pip wheel --quiet --no-deps "${isolation[@]}" --wheel-dir "$PREPARE" "$REPO"
  rm -rf "$REPO/build" "$REPO"/*.egg-info  # an in-tree build's leftovers
  echo "gpu_check: wheels for CPython $PY_VERSION x86-64 in $PREPARE ($(du -sh "$PREPARE" | cut -f1)):"
  ls -1 "$PREPARE"
  exit 0
fi

RESULTS=benchmarks/results
[[ $DRY -eq 1 ]] && RESULTS=${GPU_CHECK_OUT:-/tmp/gpu_check_dry_run}
mkdir -p "$RESULTS"
ORIGINAL_PYTHONPATH=${PYTHONPATH:-}
INSTALLED=()
if [[ -n $WHEELS ]]; then  # -- phase 0: the offline install -------------------------------------------
  WHEELS=$(cd "$WHEELS" && pwd)
  VENV=${GPU_CHECK_VENV:-/tmp/gpu_check_venv}
  VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' keras_cutbce/version.py)
  PROJECT_WHEEL=$(ls "$WHEELS"/keras_cutbce_erase-"$VERSION"-*.whl 2>/dev/null | head -1)
  [[ -n $PROJECT_WHEEL ]] || { echo "gpu_check: no keras_cutbce_erase-$VERSION wheel in $WHEELS (run --prepare)" >&2; exit 1; }
  # Only DIR: no index, no configured find-links or constraints of this machine.
  pip_offline() { env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT \
    PIP_CONFIG_FILE=/dev/null "$@" --quiet --no-index --find-links "$WHEELS" --no-cache-dir \
    --disable-pip-version-check; }
  rm -rf "$VENV"
  if [[ ${GPU_CHECK_INSTALL:-venv} == venv ]] \
     && "$HOST_PYTHON" -m venv --system-site-packages --without-pip "$VENV"; then
    # A virtualenv over a virtualenv sees the base Python's packages, not python3's: add python3's own
    # site folders (their .pth files included) after the new environment's.
    "$HOST_PYTHON" - "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" <<'PY'
import os, sys
folders = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
with open(os.path.join(sys.argv[1], "gpu_check_host_site.pth"), "w") as f:
    f.writelines(f"import site; site.addsitedir({p!r})\n" for p in folders)
PY
    PYTHON=$VENV/bin/python
    pip_offline "$PYTHON" -m pip install $(pins keras namex optree) || exit 1
    pip_offline "$PYTHON" -m pip install --no-deps "$PROJECT_WHEEL" "${PEERS[@]}" || exit 1
  else  # no virtualenv here: a folder on PYTHONPATH, every dependency already checked by the preflight
    echo "gpu_check: no virtualenv (GPU_CHECK_INSTALL=${GPU_CHECK_INSTALL:-venv}): pip install --target $VENV/site"
    PYTHON=$HOST_PYTHON
    pip_offline "$PYTHON" -m pip install --no-deps --target "$VENV/site" \
      "$WHEELS"/keras-*.whl "$WHEELS"/namex-*.whl "$WHEELS"/optree-*.whl "$PROJECT_WHEEL" \
      "$WHEELS"/cut_cross_entropy-*.whl "$WHEELS"/liger_kernel-*.whl || exit 1
    ORIGINAL_PYTHONPATH=$VENV/site${ORIGINAL_PYTHONPATH:+:$ORIGINAL_PYTHONPATH}
  fi
  INSTALLED=(--installed "$VERSION")
else
  if [[ -n ${GPU_CHECK_HOST_PYTHON:-} ]]; then  # else .venv's Python would run, silently
    echo "gpu_check: GPU_CHECK_HOST_PYTHON is the Python that --wheels installs over: add --wheels DIR" \
      "(with --dry-run: the GPU machine's install, on CPU)" >&2
    exit 1
  fi
  PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo "$HOST_PYTHON")}
fi
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac

export KERAS_BACKEND=torch PYTHONUNBUFFERED=1
# JAX is on the machine but unused: never let it initialise CUDA or take the GPU's memory.
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
DRY_FLAG=(); [[ $DRY -eq 1 ]] && DRY_FLAG=(--dry-run)
# The preflight sees only what is installed (not the checkout) and stops the check at once.
(cd /tmp && PYTHONPATH=$ORIGINAL_PYTHONPATH "$PYTHON" "$REPO/scripts/gpu_preflight.py" "${DRY_FLAG[@]}" "${INSTALLED[@]}") 2>&1 \
  | tee "$RESULTS/gpu_check_preflight.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "gpu_check: stopped by the preflight ($((SECONDS - START)) s)" >&2; exit 1; }
echo "gpu_check: install and preflight took $((SECONDS - START)) s"
[[ $INSTALL_ONLY -eq 1 ]] && exit 0
export PYTHONPATH="$REPO${ORIGINAL_PYTHONPATH:+:$ORIGINAL_PYTHONPATH}"
TOTAL=${GPU_CHECK_SECONDS:-480}
# `tests` and `cutbce` name their sections too (a rerun of a phase that failed, e.g. GPU_CHECK_PHASES=cutbce).
PHASES=" ${GPU_CHECK_PHASES:-all} "
PHASES=${PHASES/ tests / erase_tests capture matrix }
PHASES=${PHASES/ cutbce / peers cutbce_tests cutbce_rest }
FAILED=() SKIPPED=()

run_tests() {  # run_tests LOG pytest-arguments...: one pytest process, its output appended to LOG
  local log=$1; shift
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee -a "$RESULTS/$log"
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || FAILED+=("pytest $* (exit $rc)")
}

# Triton's part (peers, cutbce_*): Triton importable; on a dry run its interpreter must run the kernels.
TRITON_WHY=""
if ! "$PYTHON" -c "import triton" 2>/dev/null; then
  TRITON_WHY="triton is not importable"
elif [[ $DRY -eq 1 ]] && ! "$PYTHON" scripts/gpu_preflight.py --triton-interpreter; then
  TRITON_WHY="Triton's interpreter cannot run the kernels here (a GPU runs them compiled)"
fi
CUTBCE_DRY=(); [[ $DRY -eq 1 ]] && CUTBCE_DRY=(--cpu-dry-run)
BENCH_ARGS=(--strict --out "$RESULTS/erase_gpu")
[[ $DRY -eq 1 ]] && BENCH_ARGS+=(--cpu-dry-run)
: >"$RESULTS/gpu_check_tests.txt"

section() {  # section NAME SECONDS: run NAME's step if it is asked for and SECONDS fit in what is left
  local name=$1 seconds=$2 left=$((TOTAL - (SECONDS - START) - 15))
  [[ $PHASES == *" $name "* || $PHASES == " all " ]] || return 0
  if [[ $name == peers || $name == cutbce_* ]] && [[ -n $TRITON_WHY ]]; then
    SKIPPED+=("$name: $TRITON_WHY"); echo "gpu_check: SKIPPED $name: $TRITON_WHY" >&2; return 0
  fi
  if (( seconds > left )); then
    SKIPPED+=("$name: needs ~$seconds s, $left s left")
    echo "gpu_check: SKIPPED $name (needs ~$seconds s, $left s left)" >&2; return 0
  fi
  local begin=$SECONDS
  echo "gpu_check: $name (planned $seconds s, $left s left)"
  "step_$name" "$seconds" "$left"
  echo "gpu_check: $name took $((SECONDS - begin)) s (planned $seconds s)"
}

# -- the steps, each given (its planned seconds, the seconds left) ---------------------------------------
step_peers() {  # CutSoftmax and CutBCE beside tuned dense torch, CCE, Liger (bf16, both shapes)
  "$PYTHON" benchmarks/cutbce_triton.py --gpu "${CUTBCE_DRY[@]}" --sections peers --budget "$1" \
    --stem cutbce_triton_gpu_peers --out "$RESULTS" 2>&1 | tee "$RESULTS/cutbce_triton_gpu_peers.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || FAILED+=("benchmarks/cutbce_triton.py --sections peers (exit ${PIPESTATUS[0]})")
}
step_erase() {  # ERASE's device cells (benchmarks/erase_gpu.py --plan device, issue 49)
  local budget=(--budget "$1") plan=(--plan device)
  case " ${BENCH_EXTRA[*]-} " in *" --budget "*) budget=() ;; esac
  case " ${BENCH_EXTRA[*]-} " in *" --plan "*) plan=() ;; esac
  "$PYTHON" benchmarks/erase_gpu.py "${plan[@]}" "${BENCH_ARGS[@]}" "${budget[@]}" "${BENCH_EXTRA[@]}"
  local rc=$?
  [[ $rc -eq 0 ]] || FAILED+=("benchmarks/erase_gpu.py (exit $rc)")
}
# The ERASE GPU path's tests: device-agnostic (inputs on Keras's device, expectations keyed on it);
# CUDA-only ones skip on a dry run.
TESTS=(tests/erase/test_cuda_graphs.py tests/erase/test_cuda_graphs_lifecycle.py
       tests/erase/test_cuda_graphs_host_reads.py tests/erase/test_cuda_graphs_sharing.py
       tests/erase/test_erase_handoff.py tests/erase/test_erase_torch.py
       tests/erase/test_erase_syncs.py)
# A failed capture can leave torch's caching allocator in capture mode (torch < 2.12 without
# pytorch#180395): that test runs alone, and checks empty_cache() and a new capture after it.
CAPTURE_FAILURE=tests/erase/test_cuda_graphs.py::test_cuda_capture_failure_restores_the_stream_on_gpu
step_erase_tests() { run_tests gpu_check_tests.txt "${TESTS[@]}" --deselect "$CAPTURE_FAILURE"; }
step_capture() { run_tests gpu_check_tests.txt "$CAPTURE_FAILURE"; }
step_cutbce_tests() {  # the Triton parity tests compiled on the GPU (the interpreter on a dry run)
  : >"$RESULTS/gpu_check_cutbce_tests.txt"
  local parity=tests/cutbce/test_triton_parity.py
  [[ $DRY -eq 1 ]] && parity=tests/cutbce/test_triton_interpreter.py
  run_tests gpu_check_cutbce_tests.txt -m "" "$parity" tests/cutbce/test_triton_dispatch.py
}
step_matrix() {  # the mixed precision matrix with real bf16/fp16 kernels, autocast and CUDA Graphs
  run_tests gpu_check_tests.txt -m "" -k policy tests/erase/test_erase_schedules.py \
    tests/cutbce/test_cut_bce.py tests/cutbce/test_loss.py tests/cutbce/test_metrics.py tests/cutbce/test_retrieval.py
  # A table split over NCCL ranks (skips, saying so, with fewer than 2 GPUs).
  run_tests gpu_check_tests.txt -m "" -k nccl tests/cutbce/test_vocab_parallel_torch.py
}
step_cutbce_rest() {  # the tile sweeps first (kernels, then the chunked loop's CUDA tile), then the rest
  "$PYTHON" benchmarks/cutbce_triton.py --gpu "${CUTBCE_DRY[@]}" --budget "$2" --out "$RESULTS" \
    --sections sweep,chunked_tiles,jit,parity,timings,float16_zeros,mixed_bfloat16,graph_breaks,ncu \
    --stem cutbce_triton_gpu 2>&1 | tee "$RESULTS/cutbce_triton_gpu.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || FAILED+=("benchmarks/cutbce_triton.py (exit ${PIPESTATUS[0]})")
}

# -- the plan, in order: each section's step starts if its seconds fit in what is left ------------------
for ((i = 0; i < ${#PLAN[@]}; i += 2)); do
  section "${PLAN[i]}" "${PLAN[i + 1]}"
done
if [[ $DRY -eq 0 ]] && grep -q "needs CUDA" "$RESULTS/gpu_check_tests.txt"; then
  FAILED+=("CUDA tests skipped although CUDA is present")
fi

# Results name no machine path: in the logs this script wrote, temporary folders (the wheels' virtualenv)
# read as $TMPDIR (a log the caller tees this script's output into is the caller's to clean).
for log in gpu_check_preflight.txt gpu_check_tests.txt gpu_check_cutbce_tests.txt cutbce_triton_gpu.log \
    cutbce_triton_gpu_peers.log; do
  [[ -f $RESULTS/$log ]] && sed -i "s#/tmp/#\$TMPDIR/#g" "$RESULTS/$log"
done
echo "gpu_check: $((SECONDS - START)) s in all (budget $TOTAL s); results in $RESULTS/"
(( ${#SKIPPED[@]} )) && printf 'gpu_check: skipped (named): %s\n' "${SKIPPED[@]}"
if (( ${#FAILED[@]} )); then
  printf 'gpu_check: FAILED: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
echo "gpu_check: passed${SKIPPED[0]+ (${#SKIPPED[@]} sections skipped, named above)}"
