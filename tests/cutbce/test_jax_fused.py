"""The fused JAX training path `cut_bce_weighted_sum` (loss and gradients in one scan).

Its value and the gradients of hidden, table and bias are checked against
`sum(row_weights * reference.cut_bce(...))` and against the per-row `cut_bce`
with the row weights as cotangent, under an upstream cotangent != 1; its
jaxprs are checked for the promised work (one matmul per tile without a
gradient, three with one and no second scan) and for the absence of any
`[M, V]` array. Runs only under KERAS_BACKEND=jax; jax is imported inside
the tests.
"""

import keras
import numpy as np
import pytest

from tests.cutbce.kernel_inputs import (
    assert_close,
    hidden_table_bias,
    largest_intermediate,
    mixed_ids,
    scan_dot_counts,
)

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX fused kernel: jax backend only"
)

UPSTREAM = 2.5  # an upstream scalar cotangent != 1


def _jax():
    import jax
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import chunked

    return jax, jnp, chunked


def _problem(rng, rows, dim, vocab, length, dtype="float32", scale=1.0):
    """Random inputs (`kernel_inputs.mixed_ids`); the row weights include zeros."""
    hidden, table, bias = hidden_table_bias(rng, rows, dim, vocab, scale, dtype)
    ids = mixed_ids(rng, rows, vocab, length)
    weights = rng.uniform(0.1, 2.0, size=(rows,)).astype("float32")
    weights[[0, rows // 2]] = 0.0  # masked rows
    return hidden, table, bias, ids, weights


def _value_and_grads(objective, hidden, table, bias):
    """Jitted `UPSTREAM * objective` and its gradients w.r.t. hidden, table (and bias)."""
    jax, _, _ = _jax()
    argnums = (0, 1) if bias is None else (0, 1, 2)

    def scaled(h, t, b):
        return UPSTREAM * objective(h, t, b)

    return jax.jit(jax.value_and_grad(scaled, argnums=argnums))(hidden, table, bias)


def _objectives(ids, weights, a, p, chunk):
    """The fused sum, the reference's weighted sum and the per-row kernel's weighted sum."""
    _, jnp, chunked = _jax()
    from keras_cutbce.math import reference

    def fused(h, t, b):
        return chunked.cut_bce_weighted_sum(
            h, t, ids, b, weights, label_smoothing=a, pos_weight=p, chunk_size=chunk
        )

    def dense(h, t, b):
        loss = reference.cut_bce(h, t, ids, b, label_smoothing=a, pos_weight=p)
        return jnp.sum(weights * loss)

    def per_row(h, t, b):
        loss = chunked.cut_bce(h, t, ids, b, label_smoothing=a, pos_weight=p, chunk_size=chunk)
        return jnp.vdot(weights, loss)  # the row weights are the per-row cotangent

    return fused, dense, per_row


CASES = [
    # rows, dim, vocab, length, chunk, use_bias, smoothing, pos_weight
    (9, 6, 37, 4, 8, True, 0.0, 1.0),  # V not a multiple of the tile
    (9, 6, 37, 4, 8, False, 0.0, 1.0),  # no bias
    (8, 5, 11, 3, 16, True, 0.0, 1.0),  # V < tile
    (8, 5, 32, 3, 8, True, 0.0, 3.5),  # tile divides V, pos_weight > 1
    (7, 4, 29, 0, 8, True, 0.0, 1.0),  # L = 0
    (7, 4, 29, 1, 8, False, 0.0, 1.0),  # L = 1
    (9, 6, 41, 5, 8, True, 0.2, 1.0),  # label smoothing
    (9, 6, 41, 5, 7, False, 0.3, 0.4),  # pos_weight < 1 and smoothing, odd tile
]


@pytest.mark.parametrize("rows,dim,vocab,length,chunk,use_bias,a,p", CASES)
@pytest.mark.slow
def test_matches_reference_and_per_row_kernel(rows, dim, vocab, length, chunk, use_bias, a, p):
    hidden, table, bias, ids, weights = _problem(
        np.random.default_rng(rows * vocab + length), rows, dim, vocab, length
    )
    bias = bias if use_bias else None
    fused, dense, per_row = _objectives(ids, weights, a, p, chunk)

    value, grads = _value_and_grads(fused, hidden, table, bias)
    assert np.shape(value) == () and str(value.dtype) == "float32"
    assert len(grads) == (3 if use_bias else 2)
    for other in (dense, per_row):
        want_value, want_grads = _value_and_grads(other, hidden, table, bias)
        assert_close(value, want_value)
        for got, want in zip(grads, want_grads):
            assert got.shape == want.shape and str(got.dtype) == "float32"
            assert_close(got, want)
    # Plain evaluation (the loss-only primal) agrees with value_and_grad's value.
    assert_close(UPSTREAM * fused(hidden, table, bias), value)


def test_grad_matches_value_and_grad_and_zero_weights_give_zero_rows():
    jax, _, _ = _jax()
    hidden, table, bias, ids, weights = _problem(np.random.default_rng(3), 8, 5, 23, 3)
    fused, _, _ = _objectives(ids, weights, 0.1, 2.0, 8)
    grads = jax.jit(jax.grad(lambda h, t, b: UPSTREAM * fused(h, t, b), argnums=(0, 1, 2)))(
        hidden, table, bias
    )
    _, want = _value_and_grads(fused, hidden, table, bias)
    for got, expected in zip(grads, want):
        assert_close(got, expected, rtol=1e-6, atol=0)
    zero_rows = weights == 0
    assert zero_rows.any()
    assert np.all(np.asarray(grads[0])[zero_rows] == 0)
    assert np.all(np.abs(np.asarray(grads[0])[~zero_rows]).sum(axis=1) > 0)


def test_row_weights_get_no_gradient_and_ids_none():
    jax, jnp, chunked = _jax()
    hidden, table, bias, ids, weights = _problem(np.random.default_rng(4), 7, 4, 19, 2)

    def objective(h, w):
        return chunked.cut_bce_weighted_sum(h, table, ids, bias, w, chunk_size=4)

    grad_w = jax.grad(objective, argnums=1)(hidden, jnp.asarray(weights))
    assert grad_w.shape == weights.shape
    assert np.all(np.asarray(grad_w) == 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    hidden, table, bias, ids, weights = _problem(
        np.random.default_rng(5), 9, 6, 37, 4, scale=0.5
    )
    _, jnp, _ = _jax()
    low = [jnp.asarray(x, dtype) for x in (hidden, table, bias)]
    fused, dense, _ = _objectives(ids, weights, 0.1, 1.5, 8)
    value, grads = _value_and_grads(fused, *low)
    # The same low-precision inputs, widened: the kernel accumulates in float32.
    wide = [jnp.asarray(x, jnp.float32) for x in low]
    want_value, want_grads = _value_and_grads(dense, *wide)
    assert str(value.dtype) == "float32"
    assert_close(value, want_value, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        assert str(got.dtype) == dtype
        # Only the final rounding of each gradient to the input dtype differs.
        assert_close(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-3)


# ------------------------------------------------------------ jaxpr checks ---


@pytest.mark.parametrize("use_bias", [True, False])
def test_work_per_tile_and_no_recompute(use_bias):
    jax, _, _ = _jax()
    hidden, table, bias, ids, weights = _problem(np.random.default_rng(6), 16, 6, 67, 3)
    bias = bias if use_bias else None
    fused, _, per_row = _objectives(ids, weights, 0.1, 2.0, 8)

    # Plain evaluation: one scan over the tiles, one matmul (the logits) in it.
    assert scan_dot_counts(fused, hidden, table, bias) == [1]
    # Training: still one scan; logits, dZ @ E and [h, 1].T @ dZ; nothing recomputed.
    grad_fn = jax.value_and_grad(fused, argnums=(0, 1) if bias is None else (0, 1, 2))
    assert scan_dot_counts(grad_fn, hidden, table, bias) == [3]
    # The probe can fail: the per-row kernel's gradient scans the tiles twice.
    per_row_grad = jax.value_and_grad(per_row, argnums=(0, 1))
    assert sorted(scan_dot_counts(per_row_grad, hidden, table, bias)) == [1, 3]


def test_no_rows_by_vocab_array():
    jax, _, _ = _jax()
    rows, dim, vocab = 16, 6, 67  # M * V = 1072 > V * D = 402 > M * tile
    hidden, table, bias, ids, weights = _problem(np.random.default_rng(7), rows, dim, vocab, 3)
    fused, dense, _ = _objectives(ids, weights, 0.1, 1.0, 8)
    grad = jax.value_and_grad(fused, argnums=(0, 1, 2))
    assert largest_intermediate(fused, hidden, table, bias) < rows * vocab
    assert largest_intermediate(grad, hidden, table, bias) < rows * vocab
    # The probe sees the dense reference's [M, V] logits, so it can fail.
    dense_grad = jax.value_and_grad(dense, argnums=(0, 1, 2))
    assert largest_intermediate(dense_grad, hidden, table, bias) >= rows * vocab


# ----------------------------------------------------------- Keras training ---


def test_cut_bce_loss_fit_uses_the_fused_path(monkeypatch):
    from keras_cutbce.backends.jax import chunked
    from tests.backend_utils import fit_tied_table_model

    calls = []
    original = chunked.cut_bce_weighted_sum

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "cut_bce_weighted_sum", spy)
    losses, before, after = fit_tied_table_model()
    assert calls, "CutBCELoss did not take the fused path"
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.abs(after - before).max() > 1e-3
