"""Backend-neutral tests of the chunked CutBCE kernels (`keras_cutbce.backends.*.chunked`).

One parametrised body per behaviour, run on the active backend's kernel through
a small adapter (`ADAPTERS[backend]`: NumPy in, NumPy out); the suite runs
once per KERAS_BACKEND. Backend-only tests (jit/vmap, autograd specifics,
tf.function/XLA) stay in tests/cutbce/test_{jax,torch,tensorflow}_chunked.py.

Low-precision tolerances are calibrated as Apple's Cut Cross-Entropy tests do:
the kernel's error against the float64 truth is at most a small factor of the
error of the dense path computed in the inputs' low precision.
"""

import importlib

import keras
import numpy as np
import pytest

from keras_cutbce.math import reference
from keras_cutbce.math.coefficients import bce_coefficients
from tests.cutbce.kernel_inputs import mixed_ids

BACKEND = keras.backend.backend()


def _run_jax(fn, h, t, ids, b, cot, dtype):
    import jax
    import jax.numpy as jnp

    args = [jnp.asarray(x, dtype) for x in (h, t) + ((b,) if b is not None else ())]
    ids = jnp.asarray(ids)

    def objective(*args):
        loss = fn(args[0], args[1], ids, args[2] if len(args) == 3 else None)
        return jnp.vdot(jnp.asarray(cot), loss.astype("float32")), loss

    (_, loss), grads = jax.jit(
        jax.value_and_grad(objective, argnums=tuple(range(len(args))), has_aux=True)
    )(*args)
    return loss, list(grads)


def _run_torch(fn, h, t, ids, b, cot, dtype):
    import torch

    dt = getattr(torch, dtype)
    args = [
        torch.tensor(np.asarray(x, "float32")).to(dt).requires_grad_(True)
        for x in (h, t) + ((b,) if b is not None else ())
    ]
    loss = fn(args[0], args[1], torch.tensor(np.asarray(ids)), args[2] if len(args) == 3 else None)
    grads = torch.autograd.grad((loss.float() * torch.tensor(cot)).sum(), args)
    return loss, list(grads)


def _run_tensorflow(fn, h, t, ids, b, cot, dtype):
    import tensorflow as tf

    args = [tf.cast(tf.constant(np.asarray(x, "float32")), dtype) for x in (h, t) + ((b,) if b is not None else ())]
    with tf.GradientTape() as tape:
        tape.watch(args)
        loss = fn(args[0], args[1], tf.constant(ids), args[2] if len(args) == 3 else None)
        total = tf.reduce_sum(tf.cast(loss, tf.float32) * tf.constant(cot))
    return loss, list(tape.gradient(total, args))


ADAPTERS = {"jax": _run_jax, "torch": _run_torch, "tensorflow": _run_tensorflow}

pytestmark = pytest.mark.skipif(
    BACKEND not in ADAPTERS, reason="chunked kernels: jax, torch and tensorflow backends"
)


def _dtype_name(x):
    return str(x.dtype).replace("torch.", "").replace("<dtype: '", "").replace("'>", "")


def _np(x):
    from tests.backend_utils import to_numpy

    return np.asarray(to_numpy(x), np.float64)


def run(fn, h, t, ids, b, cot, dtype="float32"):
    """`fn(h, t, ids, b)` on the active backend: (loss, grads, loss dtype, grad dtypes) in NumPy."""
    loss, grads = ADAPTERS[BACKEND](fn, h, t, ids, b, np.asarray(cot, "float32"), dtype)
    return _np(loss), [_np(g) for g in grads], _dtype_name(loss), [_dtype_name(g) for g in grads]


def kernel(label_smoothing=0.0, pos_weight=1.0, chunk_size=128):
    chunked = importlib.import_module(f"keras_cutbce.backends.{BACKEND}.chunked")

    def fn(h, t, ids, b):
        return chunked.cut_bce(
            h, t, ids, b, label_smoothing=label_smoothing, pos_weight=pos_weight,
            chunk_size=chunk_size,
        )

    return fn


def dense(label_smoothing=0.0, pos_weight=1.0):
    def fn(h, t, ids, b):
        return reference.cut_bce(h, t, ids, b, label_smoothing=label_smoothing, pos_weight=pos_weight)

    return fn


def dense_keras(label_smoothing=0.0):
    def fn(h, t, ids, b):
        z = reference.logits(h, t, b)
        y = reference.multi_hot(ids, t.shape[0])
        return keras.losses.binary_crossentropy(y, z, from_logits=True, label_smoothing=label_smoothing)

    return fn


def dense_low_precision(label_smoothing=0.0, pos_weight=1.0):
    """The dense path computed entirely in the inputs' (low) precision."""
    from keras import ops

    coef = bce_coefficients(label_smoothing, pos_weight)

    def fn(h, t, ids, b):
        dtype = _dtype_name(h)
        z = ops.matmul(h, ops.transpose(t))
        if b is not None:
            z = z + b
        y = ops.cast(reference.multi_hot(ids, t.shape[0]), dtype)
        wm = coef.neg_target + (coef.pos_minus - coef.neg_target) * y
        plus0 = coef.neg_scale - coef.neg_target
        wp = plus0 + (coef.pos_plus - plus0) * y
        return ops.mean(wm * ops.softplus(-z) + wp * ops.softplus(z), axis=-1)

    return fn


def truth(h, t, ids, b, cot, label_smoothing=0.0, pos_weight=1.0):
    """Float64 NumPy loss and gradients of `sum(cot * loss)`."""
    h, t = np.asarray(h, np.float64), np.asarray(t, np.float64)
    z = h @ t.T + (0.0 if b is None else np.asarray(b, np.float64))
    vocab = t.shape[0]
    y = np.zeros_like(z)
    for m, row in enumerate(np.asarray(ids)):
        row = row[(row >= 0) & (row < vocab)]
        y[m, row] = 1.0
    coef = bce_coefficients(label_smoothing, pos_weight)
    wm = coef.neg_target + (coef.pos_minus - coef.neg_target) * y
    plus0 = coef.neg_scale - coef.neg_target
    wp = plus0 + (coef.pos_plus - plus0) * y
    loss = np.mean(wm * np.logaddexp(0.0, -z) + wp * np.logaddexp(0.0, z), axis=1)
    sig = 0.5 * (1.0 + np.tanh(z / 2.0))
    dz = (wp * sig - wm * (1.0 - sig)) * np.asarray(cot, np.float64)[:, None] / vocab
    grads = [dz @ t, dz.T @ h] + ([] if b is None else [dz.sum(0)])
    return loss, grads


def assert_close(got, want, rtol, atol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    assert np.all(np.isfinite(got)), what
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def problem(rng, rows, dim, vocab, length, with_bias=True, scale=0.5):
    """Random inputs; ids mix valid ids, duplicates and padding (-1, V, V + 5)."""
    h = (scale * rng.normal(size=(rows, dim))).astype("float32")
    t = (scale * rng.normal(size=(vocab, dim))).astype("float32")
    b = rng.normal(size=(vocab,)).astype("float32") if with_bias else None
    ids = mixed_ids(rng, rows, vocab, length)
    cot = rng.normal(size=(rows,)).astype("float32")
    return h, t, ids, b, cot


_SLOW = pytest.mark.slow
# rows, dim, vocab, length, chunk, bias, label_smoothing, pos_weight: the union of
# the former per-backend cases (the former JAX ones were slow there, and stay so).
CASES = [
    pytest.param(9, 6, 37, 4, 8, True, 0.0, 1.0, id="v_not_multiple_of_tile", marks=_SLOW),
    pytest.param(9, 6, 37, 4, 8, False, 0.0, 1.0, id="no_bias", marks=_SLOW),
    pytest.param(8, 5, 11, 3, 16, True, 0.0, 1.0, id="v_smaller_than_tile", marks=_SLOW),
    pytest.param(8, 5, 32, 3, 8, True, 0.0, 3.5, id="tile_divides_v_pos_weight", marks=_SLOW),
    pytest.param(7, 4, 29, 0, 8, True, 0.0, 1.0, id="no_labels", marks=_SLOW),
    pytest.param(7, 4, 29, 1, 8, False, 0.0, 1.0, id="single_label", marks=_SLOW),
    pytest.param(9, 6, 41, 5, 8, True, 0.2, 1.0, id="label_smoothing", marks=_SLOW),
    pytest.param(9, 6, 41, 5, 7, False, 0.3, 0.4, id="smoothing_pos_weight_odd_tile", marks=_SLOW),
    pytest.param(6, 3, 13, 2, 1, True, 0.1, 2.0, id="tile_of_one", marks=_SLOW),
    pytest.param(5, 4, 10, 5, 64, False, 0.0, 1.0, id="v_much_smaller_than_tile"),
    pytest.param(8, 3, 29, 5, 7, False, 0.0, 1.0, id="dups_and_padding"),
    pytest.param(6, 5, 33, 5, 10, False, 0.1, 0.3, id="smoothing_and_small_pos_weight"),
    pytest.param(9, 8, 300, 4, 128, True, 0.0, 1.0, id="large_v_not_multiple"),
    pytest.param(6, 5, 256, 3, 64, False, 0.0, 1.0, id="large_v_multiple"),
    pytest.param(4, 16, 128, 2, 128, True, 0.0, 1.0, id="one_tile_exactly"),
    pytest.param(5, 7, 50, 3, 128, False, 0.0, 1.0, id="large_tile_v_smaller"),
    pytest.param(7, 6, 130, 1, 32, True, 0.0, 1.0, id="v130_single_label"),
    pytest.param(5, 4, 90, 0, 32, False, 0.0, 1.0, id="v90_no_labels"),
    pytest.param(8, 6, 200, 4, 64, False, 0.1, 1.0, id="v200_a0.1_p1.0_nobias"),
    pytest.param(8, 6, 200, 4, 64, True, 0.1, 1.0, id="v200_a0.1_p1.0_bias"),
    pytest.param(8, 6, 200, 4, 64, False, 0.0, 2.5, id="v200_a0.0_p2.5_nobias"),
    pytest.param(8, 6, 200, 4, 64, True, 0.0, 2.5, id="v200_a0.0_p2.5_bias"),
    pytest.param(8, 6, 200, 4, 64, False, 0.3, 0.4, id="v200_a0.3_p0.4_nobias"),
    pytest.param(8, 6, 200, 4, 64, True, 0.3, 0.4, id="v200_a0.3_p0.4_bias"),
    pytest.param(8, 6, 200, 4, 64, False, 1.0, 3.0, id="v200_a1.0_p3.0_nobias"),
    pytest.param(8, 6, 200, 4, 64, True, 1.0, 3.0, id="v200_a1.0_p3.0_bias"),
]


@pytest.mark.parametrize("rows,dim,vocab,length,chunk,with_bias,a,p", CASES)
def test_matches_reference_and_keras(rows, dim, vocab, length, chunk, with_bias, a, p):
    """Loss and gradients for a random cotangent against the dense reference and Keras BCE."""
    h, t, ids, b, cot = problem(
        np.random.default_rng(rows * vocab + length), rows, dim, vocab, length, with_bias
    )
    loss, grads, loss_dtype, grad_dtypes = run(kernel(a, p, chunk), h, t, ids, b, cot)
    ref_loss, ref_grads, _, _ = run(dense(a, p), h, t, ids, b, cot)
    assert loss.shape == (rows,) and loss_dtype == "float32"
    assert len(grads) == (3 if with_bias else 2)
    assert grad_dtypes == ["float32"] * len(grads)
    assert_close(loss, ref_loss, 2e-5, 2e-6, "loss")
    for name, got, want, x in zip(("hidden", "table", "bias"), grads, ref_grads, (h, t, b)):
        assert got.shape == x.shape
        assert_close(got, want, 2e-5, 2e-6, f"d {name}")
    if p == 1.0:
        keras_loss, keras_grads, _, _ = run(dense_keras(a), h, t, ids, b, cot)
        assert_close(loss, keras_loss, 1e-4, 1e-5, "loss vs keras")
        for name, got, want in zip(("hidden", "table", "bias"), grads, keras_grads):
            assert_close(got, want, 1e-4, 1e-5, f"d {name} vs keras")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_low_precision_inputs(dtype, with_bias):
    """bf16/fp16 inputs: float32 loss, gradients in the input dtype, and the kernel's
    error against the float64 truth at most 2x the dense low-precision path's own."""
    import ml_dtypes  # noqa: F401  (NumPy bfloat16)

    h, t, ids, b, cot = problem(np.random.default_rng(4), 9, 16, 300, 4, with_bias)
    # The values the low-precision inputs hold, exactly.
    low_np = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.float16
    h, t = (x.astype(low_np).astype("float32") for x in (h, t))
    b = None if b is None else b.astype(low_np).astype("float32")
    a = 0.1
    loss, grads, loss_dtype, grad_dtypes = run(kernel(a, 1.0, 128), h, t, ids, b, cot, dtype)
    low_loss, low_grads, _, _ = run(dense_low_precision(a, 1.0), h, t, ids, b, cot, dtype)
    true_loss, true_grads = truth(h, t, ids, b, cot, a, 1.0)
    assert loss_dtype == "float32"
    assert grad_dtypes == [dtype] * len(grads)
    assert_close(loss, true_loss, 1e-5, 1e-6, "loss")  # float32 accumulation
    for name, got, low, want in zip(
        ("loss", "d hidden", "d table", "d bias"),
        [loss] + grads, [low_loss] + low_grads, [true_loss] + true_grads,
    ):
        err = np.max(np.abs(got - want))
        low_err = np.max(np.abs(low - want))
        floor = 1e-6 * max(1.0, np.max(np.abs(want)))
        assert err <= 2.0 * low_err + floor, f"{name}: {err:.3g} vs low-precision {low_err:.3g}"


def test_ids_get_no_gradient_and_bias_none():
    """No bias: gradients for hidden and table only (ids are not differentiated)."""
    h, t, ids, _, cot = problem(np.random.default_rng(8), 6, 3, 12, 2, with_bias=False)
    loss, grads, _, _ = run(kernel(chunk_size=5), h, t, ids, None, cot)
    assert len(grads) == 2
    assert grads[0].shape == h.shape and grads[1].shape == t.shape
    assert np.abs(grads[1]).sum() > 0
    want_loss, want_grads, _, _ = run(dense(), h, t, ids, None, cot)
    assert_close(loss, want_loss, 2e-5, 2e-6, "loss")
    for got, want in zip(grads, want_grads):
        assert_close(got, want, 2e-5, 2e-6, "grad")


def test_dispatch_through_ops_with_leading_dims(monkeypatch):
    """`ops.cut_binary_crossentropy(..., implementation="chunked")` on `[2, 3, D]` hidden
    reaches the active backend's kernel once, with the options as given."""
    from keras_cutbce import ops as cut_ops

    chunked = importlib.import_module(f"keras_cutbce.backends.{BACKEND}.chunked")
    calls = []
    original = chunked.cut_bce

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "cut_bce", spy)
    rng = np.random.default_rng(9)
    hidden = rng.normal(size=(2, 3, 5)).astype("float32")
    table = rng.normal(size=(26, 5)).astype("float32")
    ids = rng.integers(-1, 27, size=(2, 3, 4)).astype("int32")
    got = cut_ops.cut_binary_crossentropy(
        keras.ops.convert_to_tensor(hidden), keras.ops.convert_to_tensor(table),
        keras.ops.convert_to_tensor(ids), chunk_size=8, implementation="chunked",
        pos_weight=1.5,
    )
    want = reference.cut_bce(hidden.reshape(6, 5), table, ids.reshape(6, 4), pos_weight=1.5)
    assert calls == [dict(label_smoothing=0.0, pos_weight=1.5, chunk_size=8)]
    assert tuple(got.shape) == (2, 3)
    assert_close(_np(got).reshape(-1), _np(want), 2e-5, 2e-6, "loss")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64"])
def test_any_integer_id_dtype(dtype):
    """Ids of any integer dtype give exactly the int32 ids' loss and gradients
    (padding that each dtype can hold included)."""
    h, t, _, b, cot = problem(np.random.default_rng(2), 5, 4, 100, 0)
    ids = np.array([[0, 3, 3], [99, 1, 2], [5, 6, 100], [7, 7, 7], [8, 9, 120]])
    got = run(kernel(chunk_size=32), h, t, ids.astype(dtype), b, cot)
    want = run(kernel(chunk_size=32), h, t, ids.astype("int32"), b, cot)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(g, w)
    truth_loss, truth_grads = truth(h, t, ids, b, cot)
    assert_close(got[0], truth_loss, 2e-5, 2e-6, "loss")
    for g, w in zip(got[1], truth_grads):
        assert_close(g, w, 2e-5, 2e-6, "grad")


@pytest.mark.parametrize("a,p", [(0.0, 1.0), (0.1, 2.0)])
def test_extreme_logits_are_finite_and_exact(a, p):
    """Logits of +-200 and +-1000 (and 0), positives among them: softplus and
    sigmoid must neither overflow nor lose the exact float64 value."""
    vocab = 70
    h = np.array([[10.0, 0.0], [-10.0, 0.0], [0.0, 50.0], [0.0, 0.0]], "float32")
    t = np.zeros((vocab, 2), "float32")
    t[:, 0] = np.where(np.arange(vocab) % 2 == 0, 20.0, -20.0)  # z = +-200, rows 0 and 1
    t[:, 1] = np.where(np.arange(vocab) % 3 == 0, 20.0, -20.0)  # z = +-1000, row 2
    b = np.where(np.arange(vocab) % 5 == 0, 150.0, 0.0).astype("float32")  # row 3: 0 or 150
    ids = np.array([[0, 1, 2], [1, 3, -1], [0, 3, 5], [5, 6, vocab]])
    cot = np.array([1.5, -0.5, 2.0, 0.7], "float32")
    loss, grads, _, _ = run(kernel(a, p, chunk_size=32), h, t, ids, b, cot)
    want_loss, want_grads = truth(h, t, ids, b, cot, a, p)
    assert_close(loss, want_loss, 1e-6, 1e-6, "loss")
    for name, got, want in zip(("hidden", "table", "bias"), grads, want_grads):
        assert_close(got, want, 1e-5, 1e-5, f"d {name}")


MASK_POSITIVES = {  # torch keeps its positives as a mask over the ids instead (chunked.py)
    "jax": "keras_cutbce.backends.jax.chunked",
    "tensorflow": "keras_cutbce.backends.tensorflow.chunked",
}


@pytest.mark.skipif(BACKEND not in MASK_POSITIVES, reason="the backend has no mask_positives")
@pytest.mark.parametrize("length", [0, 1, 5, 40])
def test_mask_positives_sets_exactly_the_positives(length):
    """The O(M L) scatter puts -inf at each positive of the tile, and nowhere else."""
    mask_positives = importlib.import_module(MASK_POSITIVES[BACKEND]).mask_positives
    rng = np.random.default_rng(length)
    ids = rng.integers(-3, 70, size=(6, length)).astype("int32")
    if length:
        ids[0, :] = 64  # duplicates
    for start, width in ((0, 16), (48, 16), (64, 6)):
        z = rng.normal(size=(6, width)).astype("float32")
        want = z.copy()
        for m, row in enumerate(ids):
            for i in row:
                if start <= i < start + width:
                    want[m, i - start] = -np.inf
        got = mask_positives(
            keras.ops.convert_to_tensor(z), keras.ops.convert_to_tensor(ids), start
        )
        np.testing.assert_array_equal(_np(got), want)
