"""Tests of the JAX chunked CutBCE kernel (`keras_cutbce.backends.jax.chunked`).

Every case compares the loss and the gradients of hidden, table and bias (for a
random cotangent) with the dense reference. The checks shared with the other
backends (odd shapes against the reference and Keras BCE, bias None,
low-precision inputs, id dtypes, extreme logits, the positives' mask, dispatch
through ops) are in tests/cutbce/test_chunked.py.
"""

import keras
import numpy as np
import pytest

from tests.cutbce.kernel_inputs import (
    assert_close,
    hidden_table_bias,
    largest_intermediate,
    mixed_ids,
)

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX backend kernel"
)


def _jax():
    import jax
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import chunked

    return jax, jnp, chunked


def _problem(rng, rows, dim, vocab, length, scale=1.0, dtype="float32"):
    """Random inputs (`kernel_inputs.mixed_ids`) and a random cotangent."""
    hidden, table, bias = hidden_table_bias(rng, rows, dim, vocab, scale, dtype)
    ids = mixed_ids(rng, rows, vocab, length)
    return hidden, table, bias, ids, rng.normal(size=(rows,)).astype("float32")


def _loss_value_and_grads(loss_fn, hidden, table, bias, cotangent):
    """Jitted per-row loss, `sum(cotangent * loss)` and its gradients.

    Gradients are w.r.t. hidden, table (and bias when it is not None).
    """
    jax, jnp, _ = _jax()
    argnums = (0, 1) if bias is None else (0, 1, 2)

    def objective(h, t, b):
        loss = loss_fn(h, t, b)
        return jnp.vdot(jnp.asarray(cotangent), loss), loss

    fn = jax.jit(jax.value_and_grad(objective, argnums=argnums, has_aux=True))
    (value, loss), grads = fn(hidden, table, bias)
    return loss, value, grads


def test_duplicates_and_padding_are_ignored():
    _, jnp, chunked = _jax()
    hidden, table, bias, _, _ = _problem(np.random.default_rng(1), 6, 4, 10, 1)
    hidden = hidden[:3]
    clean = np.array([[2, -1, -1, -1], [7, 3, -1, -1], [-1, -1, -1, -1]])
    noisy = np.array([[2, 2, 10, 15], [7, 3, 3, 7], [-1, 10, -7, 15]])
    got = chunked.cut_bce(hidden, table, noisy, bias, chunk_size=4)
    want = chunked.cut_bce(hidden, table, clean, bias, chunk_size=4)
    assert_close(got, want, rtol=0, atol=0)
    empty = chunked.cut_bce(hidden, table, jnp.zeros((3, 0), "int32"), bias, chunk_size=4)
    assert_close(got[2], empty[2], rtol=0, atol=0)
    # A positive changes the loss: the check above can fail.
    assert abs(float(got[0]) - float(empty[0])) > 1e-4


def test_jit_and_default_chunk_size():
    jax, jnp, chunked = _jax()
    hidden, table, bias, ids, cotangent = _problem(np.random.default_rng(5), 9, 6, 300, 3)

    def objective(h, t, b, chunk):
        loss = chunked.cut_bce(h, t, ids, b, pos_weight=2.0, chunk_size=chunk)
        return jnp.vdot(cotangent, loss)

    eager = jax.value_and_grad(objective, argnums=(0, 1, 2))(hidden, table, bias, 64)
    jitted = jax.jit(
        jax.value_and_grad(objective, argnums=(0, 1, 2)), static_argnums=3
    )(hidden, table, bias, None)
    assert_close(jitted[0], eager[0])
    for got, want in zip(jitted[1], eager[1]):
        assert_close(got, want)


def test_vmap_over_a_leading_axis():
    jax, jnp, chunked = _jax()
    from keras_cutbce.math import reference

    rng = np.random.default_rng(6)
    batch, rows, dim, vocab = 3, 5, 4, 19
    hidden = rng.normal(size=(batch, rows, dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    bias = rng.normal(size=(vocab,)).astype("float32")
    ids = rng.integers(-2, vocab + 2, size=(batch, rows, 3)).astype("int32")
    cotangent = rng.normal(size=(batch, rows)).astype("float32")

    def objective(loss_fn):
        def total(h, t, b):
            per_example = jax.vmap(loss_fn, in_axes=(0, None, 0, None))(h, t, ids, b)
            return jnp.vdot(cotangent, per_example)

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2)))

    def cut(h, t, i, b):
        return chunked.cut_bce(h, t, i, b, label_smoothing=0.2, chunk_size=8)

    def ref(h, t, i, b):
        return reference.cut_bce(h, t, i, b, label_smoothing=0.2)

    value, grads = objective(cut)(hidden, table, bias)
    ref_value, ref_grads = objective(ref)(hidden, table, bias)
    assert_close(value, ref_value)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want)


def test_no_rows_by_vocab_array_in_forward_and_backward():
    jax, jnp, chunked = _jax()
    from keras_cutbce.math import reference

    rows, dim, vocab = 16, 6, 67  # M * V = 1072 > V * D = 402 > M * tile
    hidden, table, bias, ids, cotangent = _problem(np.random.default_rng(7), rows, dim, vocab, 3)

    def value_and_grads(loss_fn):
        def objective(h, t, b):
            return jnp.vdot(cotangent, loss_fn(h, t, ids, b))

        return jax.value_and_grad(objective, argnums=(0, 1, 2))

    def cut(h, t, i, b):
        return chunked.cut_bce(h, t, i, b, label_smoothing=0.1, chunk_size=8)

    largest = largest_intermediate(value_and_grads(cut), hidden, table, bias)
    assert largest < rows * vocab
    # The probe sees the dense reference's [M, V] logits, so it can fail.
    dense = largest_intermediate(value_and_grads(reference.cut_bce), hidden, table, bias)
    assert dense >= rows * vocab


def test_keras_fit_trains_the_tied_table():
    from tests.backend_utils import fit_tied_table_model

    losses, before, after = fit_tied_table_model()
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.abs(after - before).max() > 1e-3

