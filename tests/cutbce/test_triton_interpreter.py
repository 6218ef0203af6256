"""Runs the Triton kernels' parity tests in the Triton interpreter, in one child process.

Triton reads `TRITON_INTERPRET` when it is imported (its own `@triton.jit`
helpers are created then), so the interpreted kernels cannot run in the
suite's process without changing what every other test's Triton is: one
child process with `TRITON_INTERPRET=1` runs `tests/cutbce/
test_triton_parity.py` (reference and Keras BCE, loss and all gradients) and
the Triton kernels' cases of `tests/cutbce/test_saturated_logits.py`, on CPU
tensors, and must pass them all with none skipped. Torch backend only; skips
without Triton (`pip install '.[triton-compile]'`).
"""

import importlib.util
import os
import re
import subprocess
import sys

import keras
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="Triton kernels: torch only"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (pip install '.[triton-compile]')"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# At least this many tests must run: every parity case of both families (the policy matrix of both, the TF32
# cases), and the saturated-logit cases.
MIN_PASSED = 66


def test_parity_tests_pass_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", KERAS_BACKEND="torch", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "",
         "tests/cutbce/test_triton_parity.py", "tests/cutbce/test_saturated_logits.py",
         "-k", "(test_triton_parity or triton) and not on_a_gpu"],  # CUDA-only: the GPU check's
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= MIN_PASSED, tail
    assert "skipped" not in summary and "failed" not in summary, tail
