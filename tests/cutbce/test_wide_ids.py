"""Kernel side of wide ids: int64 ids >= 2**31 are padding, never wrapped onto valid ids.

Out-of-range ids are padding by contract. Each backend's kernels (the loss
and the top-k exclusions) get int64 ids such as `2**32 + 16` (which an int32
cast turns into item 16) and must give exactly what the same ids replaced by
-1 give.
"""

import contextlib

import keras
import numpy as np
import pytest

from tests.backend_utils import BACKEND, to_numpy

WIDE = np.array([[2**32 + 5, 7, 2**31], [2**32 + 16, -1, 2**33 + 3], [3, 2**32, 2**32 + 3]], np.int64)
CLEAN = np.where((WIDE >= 0) & (WIDE < 40), WIDE, -1).astype(np.int32)


def _inputs():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 8)).astype("float32")
    table = rng.normal(size=(40, 8)).astype("float32")
    return hidden, table


def _x64():
    """JAX with 64-bit ints on (so int64 ids reach the kernels as int64), else nothing."""
    if BACKEND != "jax":
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)  # a context manager (JAX >= 0.8)


def _loss_kernels():
    if BACKEND == "jax":
        from keras_cutbce.backends.jax import chunked, pallas

        return {
            "chunked": lambda h, t, i: chunked.cut_bce(h, t, i, chunk_size=16),
            "fused": lambda h, t, i: chunked.cut_bce_weighted_sum(
                h, t, i, None, np.ones(3, "float32"), chunk_size=16),
            "pallas": lambda h, t, i: pallas.cut_bce(h, t, i, chunk_size=128, interpret=True),
        }
    if BACKEND == "torch":
        import torch

        from keras_cutbce.backends.torch import chunked

        def tensors(h, t, i):
            return torch.as_tensor(h), torch.as_tensor(t), torch.as_tensor(i)

        return {
            "chunked": lambda h, t, i: chunked.cut_bce(*tensors(h, t, i), chunk_size=16),
            "fused": lambda h, t, i: chunked.cut_bce_weighted_sum(
                *tensors(h, t, i), None, torch.ones(3), label_smoothing=0.0, pos_weight=1.0,
                chunk_size=16),
        }
    import tensorflow as tf

    from keras_cutbce.backends.tensorflow import chunked

    kwargs = dict(label_smoothing=0.0, pos_weight=1.0, chunk_size=16)
    return {
        "chunked": lambda h, t, i: chunked.cut_bce(h, t, tf.constant(i), None, **kwargs),
        "fused": lambda h, t, i: chunked.cut_bce_weighted_sum(
            h, t, tf.constant(i), None, tf.ones(3), **kwargs),
    }


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n == "pallas" else n for n in sorted(_loss_kernels())
])
def test_loss_kernels_treat_wide_ids_as_padding(name):
    hidden, table = _inputs()
    kernel = _loss_kernels()[name]
    with _x64():
        got = to_numpy(kernel(hidden, table, WIDE))
    want = to_numpy(kernel(hidden, table, CLEAN))
    np.testing.assert_array_equal(got, want)


def _top_k(hidden, table, exclude):
    if BACKEND == "jax":
        from keras_cutbce.backends.jax import retrieval
    elif BACKEND == "torch":
        import torch

        from keras_cutbce.backends.torch import retrieval

        hidden, table, exclude = (torch.as_tensor(x) for x in (hidden, table, exclude))
    else:
        from keras_cutbce.backends.tensorflow import retrieval
    scores, ids = retrieval.top_k(hidden, table, 5, None, exclude, chunk_size=16)
    return to_numpy(scores), to_numpy(ids)


def test_top_k_exclusions_treat_wide_ids_as_padding():
    hidden, table = _inputs()
    want = _top_k(hidden, table, CLEAN)
    for context in (contextlib.nullcontext, _x64):
        with context():
            got = _top_k(hidden, table, WIDE)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])
