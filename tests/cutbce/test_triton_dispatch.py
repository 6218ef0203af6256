"""Which kernel runs under `implementation="auto"` and `"triton"` (no kernel is launched here).

CUDA tensors on torch run the Triton kernels when Triton is installed, the
chunked loop otherwise; CPU tensors run the chunked loop under `"auto"`;
`"triton"` is torch only and, on CPU tensors outside the interpreter, says
how to run it.
"""

import importlib.util

import keras
import numpy as np
import pytest

from keras_cutbce import cut_binary_crossentropy
from keras_cutbce import registry

TRITON = importlib.util.find_spec("triton") is not None


def test_auto_order_on_a_gpu(monkeypatch):
    assert registry.auto("cut_bce", "torch", "gpu") == ("triton" if TRITON else "chunked")
    assert registry.auto("cut_bce_weighted_sum", "torch", "gpu") == (
        "triton" if TRITON else "chunked")
    assert registry.auto("top_k", "torch", "gpu") == "chunked"  # no Triton retrieval
    assert registry.auto("cut_bce", "jax", "gpu") == "chunked"
    assert registry.auto("cut_bce", "torch", "cpu") == "chunked"
    monkeypatch.setitem(registry.REQUIRES, "triton", "a_library_that_is_not_installed")
    assert registry.auto("cut_bce", "torch", "gpu") == "chunked"


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="the other backends refuse it")
def test_triton_is_torch_only():
    with pytest.raises(ValueError, match="PyTorch"):
        cut_binary_crossentropy(np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                                np.zeros((2, 1), "int32"), implementation="triton")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch routing")
def test_cpu_tensors_run_the_chunked_loop_under_auto(monkeypatch):
    from keras_cutbce.backends.torch import triton

    def refuse(*args, **kwargs):
        raise AssertionError("auto routed CPU tensors to the Triton kernels")

    monkeypatch.setattr(triton, "cut_bce", refuse)
    monkeypatch.setattr(triton, "cut_bce_weighted_sum", refuse)
    loss = cut_binary_crossentropy(np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                                   np.zeros((2, 1), "int32"))
    assert tuple(loss.shape) == (2,)


@pytest.mark.skipif(keras.backend.backend() != "torch" or not TRITON, reason="torch with Triton")
def test_triton_on_cpu_outside_the_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        cut_binary_crossentropy(np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                                np.zeros((2, 1), "int32"), implementation="triton")
