#!/usr/bin/env bash
# The ERASE GPU check: one command for a person with a CUDA GPU (torch backend).
#
#   scripts/gpu_check.sh              # CUDA tests + benchmarks/erase_gpu.py (full)
#   scripts/gpu_check.sh --quick      # same, one batch size and fewer steps
#   scripts/gpu_check.sh --dry-run    # no GPU: checks this script's steps on CPU (nothing measured)
#
# 1. runs the CUDA tests (tests/erase/test_cuda_graphs.py, tests/erase/test_erase_torch.py) and fails if
#    any of them was skipped for lack of CUDA;
# 2. runs benchmarks/erase_gpu.py --strict: standard / blocking / threaded / streams / auto,
#    each with and without CUDA Graphs, on the CTR example (its towers hand their input
#    gradient over: upstream_backwards_per_step must be 1) and the 30-layer MLP sanity check;
#    it fails if a graph mode did not capture and replay graphs, or if the profiler trace of
#    the CTR model's "streams" step shows no block backward overlapping a later block's
#    forward on another stream; the table says how many of auto's measuring steps were timed;
# 3. writes under benchmarks/results/: erase_gpu.md / .json (tables: p50/p90 of per-step
#    examples/s, p90 = the fast end), erase_gpu_trace.json (torch profiler, chrome://tracing),
#    erase_gpu_timeline.png (overlap timeline per stream/thread), gpu_check_tests.txt.
# Environment: PYTHON (default: python), extra arguments go to erase_gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}  # the project venv when there is one
export KERAS_BACKEND=torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=benchmarks/results
TESTS=(tests/erase/test_cuda_graphs.py tests/erase/test_cuda_graphs_lifecycle.py tests/erase/test_erase_handoff.py
       tests/erase/test_erase_torch.py)

if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  OUT=${GPU_CHECK_OUT:-/tmp/gpu_check_dry_run}
  mkdir -p "$OUT"
  echo "gpu_check: dry run on CPU (CUDA tests skip, graphs use the CPU stand-in capture) -> $OUT"
  "$PYTHON" -m pytest -q -rs "${TESTS[@]}" -k "cuda or graph or stream" | tee "$OUT/gpu_check_tests.txt"
  "$PYTHON" benchmarks/erase_gpu.py --cpu-dry-run --strict --out "$OUT/erase_gpu" "$@"
  exit 0
fi

"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (run scripts/gpu_check.sh --dry-run on CPU)")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
mkdir -p "$RESULTS"
"$PYTHON" -m pytest -q -rs "${TESTS[@]}" | tee "$RESULTS/gpu_check_tests.txt"
if grep -q "needs CUDA" "$RESULTS/gpu_check_tests.txt"; then
  echo "gpu_check: some CUDA tests were skipped although CUDA is present" >&2
  exit 1
fi
"$PYTHON" benchmarks/erase_gpu.py --strict --out "$RESULTS/erase_gpu" "$@"
# --- CutBCE on CUDA: the fused Triton kernels (benchmarks/cutbce_triton.py; issue 24) ---
# The parity tests run compiled on the GPU (no interpreter); then parity vs dense (TF32 off), dense /
# chunked / triton alternating (median of 5, peak memory) and a tile sweep, within CUTBCE_GPU_BUDGET s.
if "$PYTHON" -c "import triton" 2>/dev/null; then
  "$PYTHON" -m pytest -q -rs -m "" tests/cutbce/test_triton_parity.py tests/cutbce/test_saturated_logits.py -k "parity or triton" \
    | tee "$RESULTS/gpu_check_cutbce_tests.txt"
  "$PYTHON" benchmarks/cutbce_triton.py --gpu --budget "${CUTBCE_GPU_BUDGET:-150}" --out "$RESULTS" \
    | tee "$RESULTS/cutbce_triton_gpu.log"
else
  echo "gpu_check: triton is not importable: the CutBCE Triton part is skipped" >&2
fi
# --- end of the CutBCE part ---
echo "gpu_check: done; results in $RESULTS/erase_gpu.md, erase_gpu_trace.json, erase_gpu_timeline.png"
