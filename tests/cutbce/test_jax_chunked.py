"""Tests of the JAX chunked CutBCE kernel (`keras_cutbce.backends.jax.chunked`).

Every case compares the loss and the gradients of hidden, table and bias (for a
random cotangent) with the dense reference. The checks shared with the other
backends (odd shapes against the reference and Keras BCE, bias None,
low-precision inputs, dispatch through ops) are in tests/cutbce/test_chunked.py.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX backend kernel"
)


def _jax():
    import jax
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import chunked

    return jax, jnp, chunked


def _problem(rng, rows, dim, vocab, length, scale=1.0, dtype="float32"):
    """Random inputs; ids mix valid ids, duplicates and padding (-1, V, V + 5)."""
    hidden = (scale * rng.normal(size=(rows, dim))).astype(dtype)
    table = rng.normal(size=(vocab, dim)).astype(dtype)
    bias = rng.normal(size=(vocab,)).astype(dtype)
    ids = rng.integers(0, vocab, size=(rows, length)).astype("int32")
    if length >= 2:
        ids[0, 1] = ids[0, 0]  # duplicate
        ids[1, :] = ids[1, 0]  # a row of one repeated id
        ids[2, -1] = -1
    if length >= 1:
        ids[3, -1] = vocab
        ids[4, 0] = vocab + 5
        ids[5, :] = -1  # a row with no valid id
    cotangent = rng.normal(size=(rows,)).astype("float32")
    return hidden, table, bias, ids, cotangent


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


def _value_and_grads(loss_fn, hidden, table, bias, cotangent):
    """`sum(cotangent * loss)` and its gradients (see `_loss_value_and_grads`)."""
    return _loss_value_and_grads(loss_fn, hidden, table, bias, cotangent)[1:]


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol
    )


def test_duplicates_and_padding_are_ignored():
    _, jnp, chunked = _jax()
    hidden, table, bias, _, _ = _problem(np.random.default_rng(1), 6, 4, 10, 1)
    hidden = hidden[:3]
    clean = np.array([[2, -1, -1, -1], [7, 3, -1, -1], [-1, -1, -1, -1]])
    noisy = np.array([[2, 2, 10, 15], [7, 3, 3, 7], [-1, 10, -7, 15]])
    got = chunked.cut_bce(hidden, table, noisy, bias, chunk_size=4)
    want = chunked.cut_bce(hidden, table, clean, bias, chunk_size=4)
    _assert_close(got, want, rtol=0, atol=0)
    empty = chunked.cut_bce(hidden, table, jnp.zeros((3, 0), "int32"), bias, chunk_size=4)
    _assert_close(got[2], empty[2], rtol=0, atol=0)
    # A positive changes the loss: the check above can fail.
    assert abs(float(got[0]) - float(empty[0])) > 1e-4


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint32"])
def test_integer_id_dtypes(dtype):
    _, _, chunked = _jax()
    hidden, table, bias, _, _ = _problem(np.random.default_rng(2), 6, 3, 100, 1)
    hidden = hidden[:4]
    ids = np.array([[1, 2], [99, 99], [0, 50], [3, 7]])
    got = chunked.cut_bce(hidden, table, ids.astype(dtype), bias, chunk_size=32)
    want = chunked.cut_bce(hidden, table, ids.astype("int32"), bias, chunk_size=32)
    _assert_close(got, want, rtol=0, atol=0)


def test_large_logits_are_finite_and_exact():
    jax, jnp, chunked = _jax()
    from keras_cutbce.math import reference

    rng = np.random.default_rng(3)
    hidden, table, bias, ids, cotangent = _problem(rng, 8, 4, 23, 3)
    hidden = hidden * 60.0  # logits spread over about +-300
    z = np.asarray(reference.logits(hidden, table, bias))
    assert z.max() > 200 and z.min() < -200

    def cut(h, t, b):
        return chunked.cut_bce(h, t, ids, b, label_smoothing=0.1, chunk_size=8)

    def ref(h, t, b):
        return reference.cut_bce(h, t, ids, b, label_smoothing=0.1)

    value, grads = _value_and_grads(cut, hidden, table, bias, cotangent)
    ref_value, ref_grads = _value_and_grads(ref, hidden, table, bias, cotangent)
    assert np.isfinite(float(value))
    _assert_close(value, ref_value, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(got)))
        _assert_close(got, want, rtol=1e-4, atol=1e-4)


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
    _assert_close(jitted[0], eager[0])
    for got, want in zip(jitted[1], eager[1]):
        _assert_close(got, want)


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
    _assert_close(value, ref_value)
    for got, want in zip(grads, ref_grads):
        _assert_close(got, want)


def _largest_intermediate(fn, *args):
    """Largest number of elements of any value computed in `fn`'s jaxpr (sub-jaxprs too)."""
    jax, _, _ = _jax()

    def sub_jaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from sub_jaxprs(item)

    def walk(jaxpr):
        largest = 0
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
            for param in eqn.params.values():
                for sub in sub_jaxprs(param):
                    largest = max(largest, walk(sub))
        return largest

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


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

    largest = _largest_intermediate(value_and_grads(cut), hidden, table, bias)
    assert largest < rows * vocab
    # The probe sees the dense reference's [M, V] logits, so it can fail.
    dense = _largest_intermediate(value_and_grads(reference.cut_bce), hidden, table, bias)
    assert dense >= rows * vocab


def test_keras_fit_trains_the_tied_table():
    from tests.backend_utils import fit_tied_table_model

    losses, before, after = fit_tied_table_model()
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.abs(after - before).max() > 1e-3


@pytest.mark.parametrize("length", [0, 1, 5, 40])
def test_mask_positives_sets_exactly_the_positives(length):
    """The O(M L) scatter puts -inf at each positive of the tile, and nowhere else."""
    jax, jnp, chunked = _jax()
    rng = np.random.default_rng(length)
    ids = rng.integers(-3, 70, size=(6, length)).astype("int32")
    if length:
        ids[0, :] = 64  # duplicates
    for start, width in ((0, 16), (48, 16), (64, 6)):
        z = rng.normal(size=(6, width)).astype("float32")
        got = np.asarray(chunked.mask_positives(jnp.asarray(z), jnp.asarray(ids), start))
        want = z.copy()
        for m, row in enumerate(ids):
            for i in row:
                if start <= i < start + width:
                    want[m, i - start] = -np.inf
        np.testing.assert_array_equal(got, want)
