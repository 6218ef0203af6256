"""Suite-wide setup and fixtures.

A test that takes seconds (a subprocess, a training run, a kernel in
interpret mode) carries `@pytest.mark.slow` where it is defined (a whole
file: `pytestmark`), so `python -m pytest -m "not slow"` is the quick
edit-test loop and CI (`bash scripts/test.sh`) still runs everything.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def _pin_cpu_when_libtpu_has_no_tpu():
    """With libtpu installed (the TPU compile tests) but no TPU or GPU here, JAX
    would probe for a TPU (and take libtpu's lock) in every process: run the
    ordinary suite on the CPU. The compile tests' child process unsets this."""
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


_pin_cpu_when_libtpu_has_no_tpu()

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)
