#!/usr/bin/env bash
# The GPU check (ERASE, then CutBCE's Triton kernels): one command for a person with a CUDA GPU
# (torch backend).
#
#   scripts/gpu_check.sh              # CUDA tests + erase_gpu.py + cutbce_triton.py, within 8 minutes
#   scripts/gpu_check.sh --quick      # same, one batch size and fewer steps
#   scripts/gpu_check.sh --dry-run    # no GPU: the same steps on CPU (nothing measured)
#
# 1. runs the GPU path's tests (TESTS below; every one is device-agnostic: inputs on Keras's device,
#    expectations keyed on the device) and notes a failure, or a test skipped for lack of CUDA
#    although CUDA is present, without stopping: the benchmark still runs and writes its results;
# 2. runs benchmarks/erase_gpu.py --strict --budget <what is left of GPU_CHECK_SECONDS>: the trace of
#    one CTR "streams" step first (its timeline PNG; the overlap of a block's backward with a later
#    block's forward is read from the kernels' device times per stream), then standard / blocking /
#    threaded / streams / auto, each with and without CUDA Graphs, on the CTR example and the 30-layer
#    MLP, 3 alternating repeats per cell (median and spread of p50/p90 QPS, host time per step); it
#    starts no cell that would end past the budget and always writes what it has; --strict fails if
#    a graph mode did not capture and replay graphs, if no overlap is found, or if a cell failed;
# 2b. when Triton is importable, keeps CUTBCE_GPU_SECONDS (default 180) of the total for CutBCE: the
#    Triton parity tests compiled on the GPU, then benchmarks/cutbce_triton.py --gpu --budget <the rest>
#    (parity vs dense with TF32 off, dense / chunked / triton alternating, a tile sweep);
# 3. writes under benchmarks/results/: erase_gpu.md / .json, erase_gpu_trace.json (torch profiler,
#    chrome://tracing), erase_gpu_timeline.png, gpu_check_tests.txt, cutbce_triton_gpu.json / .log,
#    gpu_check_cutbce_tests.txt; exits 1 if any step failed.
#
# Time. GPU_CHECK_SECONDS (default 480: 8 minutes) bounds the whole check; the benchmark gets what the
# tests and the CutBCE part's reserve left, minus 20 s for writing the results (at least 60 s).
# Measured: --dry-run on the project's 2-core CPU machine, shared with three other jobs (load average
# 9): 230 s in all (tests 74 s: 104 passed, 9 CUDA-only skipped; benchmark 147 s: trace, exactness, 24
# cells). Estimated on one H200: the tests 1-2 minutes (the same tests, most of them host-bound Keras
# steps, on a 16-core host; the CUDA-only ones add seconds), then the benchmark until the 8 minutes
# are used (trace, exactness and the CTR cells come first; the MLP cells last, cut by the budget if
# need be); the machine's start-up (minutes) is extra.
# Environment: PYTHON (default: the project's .venv Python, else python), GPU_CHECK_SECONDS, CUTBCE_GPU_SECONDS,
# GPU_CHECK_OUT (the dry run's folder); extra arguments go to erase_gpu.py (e.g. --budget 300).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}  # the project venv when there is one
export KERAS_BACKEND=torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOTAL=${GPU_CHECK_SECONDS:-480}
TESTS=(tests/erase/test_cuda_graphs.py tests/erase/test_cuda_graphs_lifecycle.py
       tests/erase/test_cuda_graphs_host_reads.py tests/erase/test_erase_handoff.py
       tests/erase/test_erase_torch.py tests/erase/test_erase_syncs.py)
FAILED=()

if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  DRY=1
  RESULTS=${GPU_CHECK_OUT:-/tmp/gpu_check_dry_run}
  BENCH_ARGS=(--cpu-dry-run)
  echo "gpu_check: dry run on CPU (CUDA tests skip, graphs use the CPU stand-in capture) -> $RESULTS"
else
  DRY=0
  RESULTS=benchmarks/results
  BENCH_ARGS=()
  if ! "$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (run scripts/gpu_check.sh --dry-run on CPU)")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
  then
    exit 1
  fi
fi
mkdir -p "$RESULTS"

"$PYTHON" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" | tee "$RESULTS/gpu_check_tests.txt"
TEST_RC=${PIPESTATUS[0]}
[[ $TEST_RC -eq 0 ]] || FAILED+=("tests (pytest exit $TEST_RC)")
if [[ $DRY -eq 0 ]] && grep -q "needs CUDA" "$RESULTS/gpu_check_tests.txt"; then
  FAILED+=("CUDA tests skipped although CUDA is present")
fi
# Mixed precision matrix on CUDA, real bf16/fp16 kernels and CUDA Graphs (the Triton one: test_triton_parity.py below).
"$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "" -k policy tests/erase/test_erase_schedules.py tests/cutbce/test_cut_bce.py tests/cutbce/test_loss.py tests/cutbce/test_metrics.py tests/cutbce/test_retrieval.py | tee "$RESULTS/gpu_check_mixed_precision.txt"; [[ ${PIPESTATUS[0]} -eq 0 ]] || FAILED+=("mixed precision matrix")
TESTS_S=$((SECONDS - START))

# The CutBCE part (below) keeps CUTBCE_GPU_SECONDS of the total when Triton is importable.
CUTBCE_S=0
if "$PYTHON" -c "import triton" 2>/dev/null; then CUTBCE_S=${CUTBCE_GPU_SECONDS:-180}; fi
BUDGET=$((TOTAL - TESTS_S - CUTBCE_S - 20))
(( BUDGET >= 60 )) || BUDGET=60
case " $* " in *" --budget "*) BUDGET_ARGS=() ;; *) BUDGET_ARGS=(--budget "$BUDGET") ;; esac
echo "gpu_check: tests took ${TESTS_S} s; benchmark budget: ${BUDGET_ARGS[1]:-from the arguments} s"
"$PYTHON" benchmarks/erase_gpu.py "${BENCH_ARGS[@]}" --strict "${BUDGET_ARGS[@]}" \
  --out "$RESULTS/erase_gpu" "$@"
BENCH_RC=$?
[[ $BENCH_RC -eq 0 ]] || FAILED+=("benchmarks/erase_gpu.py (exit $BENCH_RC)")

# -- ERASE part ends here. ---------------------------------------------------------------------------

# -- CutBCE on CUDA: the fused Triton kernels (benchmarks/cutbce_triton.py), in CUTBCE_S seconds ------
# Their parity tests (compiled on the GPU; in the Triton interpreter on a dry run), then parity of
# triton and chunked vs dense (TF32 off), dense / chunked / triton alternating (median of 5, peak
# memory) and a tile sweep, within what is left of CUTBCE_S.
if (( CUTBCE_S > 0 )); then
  CUTBCE_START=$SECONDS
  if [[ $DRY -eq 1 ]]; then
    CUTBCE_TESTS=(tests/cutbce/test_triton_interpreter.py tests/cutbce/test_triton_dispatch.py)
    CUTBCE_ARGS=(--cpu-dry-run)
  else
    CUTBCE_TESTS=(tests/cutbce/test_triton_parity.py tests/cutbce/test_triton_dispatch.py)
    CUTBCE_ARGS=()
  fi
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "" "${CUTBCE_TESTS[@]}" \
    | tee "$RESULTS/gpu_check_cutbce_tests.txt"
  CUTBCE_RC=${PIPESTATUS[0]}
  [[ $CUTBCE_RC -eq 0 ]] || FAILED+=("CutBCE Triton tests (pytest exit $CUTBCE_RC)")
  CUTBCE_BUDGET=$((CUTBCE_S - (SECONDS - CUTBCE_START) - 10))
  (( CUTBCE_BUDGET >= 30 )) || CUTBCE_BUDGET=30
  "$PYTHON" benchmarks/cutbce_triton.py --gpu "${CUTBCE_ARGS[@]}" --budget "$CUTBCE_BUDGET" \
    --out "$RESULTS" | tee "$RESULTS/cutbce_triton_gpu.log"
  CUTBCE_RC=${PIPESTATUS[0]}
  [[ $CUTBCE_RC -eq 0 ]] || FAILED+=("benchmarks/cutbce_triton.py (exit $CUTBCE_RC)")
else
  echo "gpu_check: triton is not importable: the CutBCE Triton part is skipped" >&2
fi
# -- CutBCE part ends here. ----------------------------------------------------------------------------

echo "gpu_check: $((SECONDS - START)) s in all (tests ${TESTS_S} s); results in $RESULTS/:" \
     "erase_gpu.md, erase_gpu.json, erase_gpu_trace.json, erase_gpu_timeline.png, gpu_check_tests.txt," \
     "cutbce_triton_gpu.json, cutbce_triton_gpu.log, gpu_check_cutbce_tests.txt"
if (( ${#FAILED[@]} )); then
  printf 'gpu_check: FAILED: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
echo "gpu_check: passed"
