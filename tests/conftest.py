"""Suite-wide setup and fixtures.

A test that takes seconds (a subprocess, a training run, a kernel in
interpret mode) carries `@pytest.mark.slow` where it is defined (a whole
file: `pytestmark`), so `python -m pytest -m "not slow"` is the quick
edit-test loop and CI (`bash scripts/test.sh`) still runs everything.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def _quiet_start():
    """The examples' quiet start (`examples.quiet_start`): with libtpu but no TPU or GPU here, JAX runs on the
    CPU instead of probing for a TPU (and taking libtpu's lock) in every process; the TPU compile tests' child
    process unsets it."""
    from examples import quiet_start

    quiet_start(os.environ["KERAS_BACKEND"])


_quiet_start()

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)
