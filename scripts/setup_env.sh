#!/usr/bin/env bash
# Creates (or reuses) the virtualenv .venv in the repository and installs the
# project with every backend, the TPU compiler (libtpu) and Triton (for the
# compile tests), pinned by constraints.txt. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  # Every extra in one resolve and one editable build (Python 3.11's own pip
  # installs a pyproject project editable: no pip upgrade first). tpu-compile:
  # the TPU compiler (libtpu) for tests/cutbce/test_tpu_compile.py; it compiles
  # for deviceless TPUs, and the ordinary JAX tests pin the CPU (tests/conftest.py).
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[all,tpu-compile]"
  # Triton (the CUDA wheels' pin) for the fused CUDA kernels' interpreter and
  # compile tests; --no-deps: it must not replace the CPU torch.
  .venv/bin/python -m pip install --quiet --no-deps -c constraints.txt "triton==3.7.1"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# A quiet start for every Python of .venv (README blocks, your scripts): this
# machine-wide libtpu would make JAX probe for a TPU at its first op (libtpu's
# INVALID_ARGUMENT / TPU_WORKER_HOSTNAMES lines, its lock) where none is attached,
# so JAX_PLATFORMS=cpu unless a TPU or GPU device file exists; under
# KERAS_BACKEND=jax or torch, TensorFlow (keras.utils.set_random_seed imports it)
# starts without its oneDNN lines. A variable already set wins (JAX_PLATFORMS=""
# restores JAX's own choice). Copied on every run: cheap, and current.
for site in .venv/lib/python3*/site-packages; do
  cmp -s scripts/quiet_start.pth "$site/keras_cutbce_quiet_start.pth" \
    || cp scripts/quiet_start.pth "$site/keras_cutbce_quiet_start.pth"
done
