"""Tests of the JAX chunked CutBCE kernel (`keras_cutbce.backends.jax.chunked`).

Every case compares the loss and the gradients of hidden, table and bias (for a
random cotangent) with the dense reference and with
`keras.losses.binary_crossentropy` on the dense logits.
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


def _dense_keras(ids, vocab, a):
    from keras_cutbce.math import reference

    multi_hot = reference.multi_hot(ids, vocab)

    def loss_fn(h, t, b):
        z = reference.logits(h, t, b)
        return keras.losses.binary_crossentropy(
            multi_hot, z, from_logits=True, label_smoothing=a
        )

    return loss_fn


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol
    )


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
    (6, 3, 13, 2, 1, True, 0.1, 2.0),  # tile of one item
]


@pytest.mark.parametrize("rows,dim,vocab,length,chunk,use_bias,a,p", CASES)
@pytest.mark.slow
def test_matches_reference_and_keras(rows, dim, vocab, length, chunk, use_bias, a, p):
    _, _, chunked = _jax()
    from keras_cutbce.math import reference

    hidden, table, bias, ids, cotangent = _problem(
        np.random.default_rng(rows * vocab + length), rows, dim, vocab, length
    )
    bias = bias if use_bias else None

    def cut(h, t, b):
        return chunked.cut_bce(
            h, t, ids, b, label_smoothing=a, pos_weight=p, chunk_size=chunk
        )

    def ref(h, t, b):
        return reference.cut_bce(h, t, ids, b, label_smoothing=a, pos_weight=p)

    loss, value, grads = _loss_value_and_grads(cut, hidden, table, bias, cotangent)
    ref_loss, ref_value, ref_grads = _loss_value_and_grads(
        ref, hidden, table, bias, cotangent
    )
    assert loss.shape == (rows,) and str(loss.dtype) == "float32"
    _assert_close(loss, ref_loss)
    _assert_close(value, ref_value)
    for got, want in zip(grads, ref_grads):
        _assert_close(got, want)
    if p == 1.0:
        keras_value, keras_grads = _value_and_grads(
            _dense_keras(ids, vocab, a), hidden, table, bias, cotangent
        )
        _assert_close(value, keras_value, rtol=1e-4, atol=1e-5)
        for got, want in zip(grads, keras_grads):
            _assert_close(got, want, rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    jax, jnp, chunked = _jax()
    from keras_cutbce.math import reference

    hidden, table, bias, ids, cotangent = _problem(np.random.default_rng(4), 9, 8, 45, 3)
    low = [jnp.asarray(x, dtype) for x in (hidden, table, bias)]
    exact = [np.asarray(x, np.float32) for x in low]  # the same values in float32

    def cut(h, t, b):
        return chunked.cut_bce(h, t, ids, b, label_smoothing=0.1, chunk_size=16)

    def ref(h, t, b):
        return reference.cut_bce(h, t, ids, b, label_smoothing=0.1)

    loss, _, grads = _loss_value_and_grads(cut, *low, cotangent)
    ref_loss, _, ref_grads = _loss_value_and_grads(ref, *exact, cotangent)
    assert str(loss.dtype) == "float32"
    _assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)  # float32 accumulation
    for got, want, x in zip(grads, ref_grads, low):
        assert got.dtype == x.dtype
        _assert_close(got.astype("float32"), want, rtol=2e-2, atol=2e-3)


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


def test_ids_get_no_gradient_and_bias_none():
    jax, jnp, chunked = _jax()
    hidden, table, _, ids, _ = _problem(np.random.default_rng(8), 6, 3, 12, 2)
    grads = jax.grad(
        lambda h, t: chunked.cut_bce(h, t, ids, None, chunk_size=5).sum(), argnums=(0, 1)
    )(hidden, table)
    assert grads[0].shape == hidden.shape and grads[1].shape == table.shape
    assert float(jnp.abs(grads[1]).sum()) > 0


def test_dispatch_through_ops_with_leading_dims():
    from keras_cutbce import ops as cut_ops
    from keras_cutbce.math import reference

    rng = np.random.default_rng(9)
    hidden = rng.normal(size=(2, 3, 5)).astype("float32")
    table = rng.normal(size=(26, 5)).astype("float32")
    ids = rng.integers(-1, 27, size=(2, 3, 4))
    got = cut_ops.cut_binary_crossentropy(
        hidden, table, ids, chunk_size=8, implementation="chunked", pos_weight=1.5
    )
    want = reference.cut_bce(hidden.reshape(6, 5), table, ids.reshape(6, 4), pos_weight=1.5)
    assert tuple(got.shape) == (2, 3)
    _assert_close(np.asarray(got).reshape(-1), want)


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
