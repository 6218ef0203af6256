"""Every kernel is exact at saturated logits.

A positive's term must not be added densely as `softplus(z) ~ z` and then
subtracted back: with an identity table (`z = h` exactly in float32) the
cases below put positives at `z = 1e4`, `z = 100` and `17 < z < 30`, and
build a row whose true loss is ~1e-43. Every kernel of the active backend
(per-row and fused weighted sum; Pallas in the TPU interpreter on JAX) is
compared, loss and gradients for hidden, table and bias, with float64 math
and with Keras's `binary_crossentropy` on the dense float32 logits.
"""

import keras
import numpy as np
import pytest

from tests.backend_utils import BACKEND, to_numpy, value_and_grads

VOCAB = 18  # = D: identity table; chunk 4 leaves a remainder tile of 2
CHUNK = 4
TINY = float(np.finfo(np.float32).tiny)  # 1.2e-38
CASES = [(0.0, 1.0), (0.1, 1.0), (0.0, 3.0), (0.2, 2.5)]


def _problem():
    """Logits `z [6, 18]` (rows of `h`), targets `[6, 3]`, cotangent `[6]`."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6, VOCAB)) * 3.0
    ids = np.array(
        [[0, -1, -1], [1, 1, 17], [2, VOCAB, -1], [3, 4, 16], [6, -1, -1], [7, 8, 9]]
    )
    z[0] = -20.0
    z[0, 0] = 1e4  # a |z| = 1e4 positive among saturated negatives: loss ~2e-9
    z[1] = -100.0
    z[1, 1], z[1, 17] = 100.0, 100.0  # true loss ~3.7e-44 (a row of 1e-43)
    z[2, 2] = 100.0
    z[3, 3], z[3, 4], z[3, 16] = 17.5, 23.0, 29.0  # gradients -sigmoid(-z) ~ 1e-8 .. 1e-13
    z[4, 6] = -1e4  # a positive at -1e4: its term is 1e4
    z[5] = -30.0
    z[5, 7:10] = [35.0, 1e3, 60.0]  # loss ~8e-14
    hidden = z.astype("float32")
    table = np.eye(VOCAB, dtype="float32")
    bias = np.zeros(VOCAB, "float32")
    cotangent = rng.uniform(0.5, 1.5, size=(6,)).astype("float32")
    return hidden, table, bias, ids, cotangent


def _float64_oracle(hidden, ids, cotangent, a, p):
    """Per-row loss `[M]` and the gradients of `sum(g * loss)` (identity table, zero bias)."""
    z = hidden.astype(np.float64)
    y = np.zeros_like(z)
    for m, row in enumerate(ids):
        for i in row:
            if 0 <= i < VOCAB:
                y[m, i] = 1.0
    y = y * (1.0 - a) + a / 2.0
    softplus = lambda x: np.logaddexp(0.0, x)  # noqa: E731
    sigmoid = lambda x: np.exp(-np.logaddexp(0.0, -x))  # noqa: E731
    terms = p * y * softplus(-z) + (1.0 - y) * softplus(z)
    slopes = (1.0 - y) * sigmoid(z) - p * y * sigmoid(-z)
    dz = cotangent.astype(np.float64)[:, None] * slopes / VOCAB
    # z = h @ I + 0: d/dh = dz, d/dtable = dz.T @ h, d/dbias = sum_m dz.
    return terms.mean(axis=1), dz, dz.T @ z, dz.sum(axis=0)


def _kernels():
    """`name -> (per_row, fn)`: `fn(h, t, ids, b, g, a, p)` is a per-row loss or `sum(g * loss)`."""
    if BACKEND == "jax":
        from keras_cutbce.backends.jax import chunked
        from keras_cutbce.backends.jax.pallas import cut_bce as pallas_cut_bce

        def pallas(h, t, ids, b, g, a, p):
            return pallas_cut_bce(
                h, t, ids, b, label_smoothing=a, pos_weight=p, chunk_size=128, interpret=True
            )

        return {
            "jax_chunked": (True, lambda h, t, i, b, g, a, p: chunked.cut_bce(
                h, t, i, b, label_smoothing=a, pos_weight=p, chunk_size=CHUNK)),
            "jax_fused": (False, lambda h, t, i, b, g, a, p: chunked.cut_bce_weighted_sum(
                h, t, i, b, g, label_smoothing=a, pos_weight=p, chunk_size=CHUNK)),
            "pallas": (True, pallas),
        }
    if BACKEND == "torch":
        from keras_cutbce.backends.torch import chunked

        kernels = {
            "torch_chunked": (True, lambda h, t, i, b, g, a, p: chunked.cut_bce(
                h, t, i, b, label_smoothing=a, pos_weight=p, chunk_size=CHUNK)),
            "torch_fused": (False, lambda h, t, i, b, g, a, p: chunked.cut_bce_weighted_sum(
                h, t, i, b, g, label_smoothing=a, pos_weight=p, chunk_size=CHUNK)),
        }
        from tests.cutbce.test_triton_parity import triton_runs_here

        if triton_runs_here():  # in the Triton interpreter's child process (or on a GPU)
            from keras_cutbce.backends.torch.triton import launch as triton

            kernels["torch_triton"] = (True, lambda h, t, i, b, g, a, p: triton.cut_bce(
                h, t, i, b, label_smoothing=a, pos_weight=p))
            kernels["torch_triton_fused"] = (False, lambda h, t, i, b, g, a, p:
                                             triton.cut_bce_weighted_sum(
                                                 h, t, i, b, g, label_smoothing=a, pos_weight=p))
        return kernels
    from keras_cutbce.backends.tensorflow import chunked

    kernels = {
        "tf_chunked": (True, lambda h, t, i, b, g, a, p: chunked.cut_bce(
            h, t, i, b, label_smoothing=a, pos_weight=p, chunk_size=CHUNK)),
    }
    if hasattr(chunked, "cut_bce_weighted_sum"):
        kernels["tf_fused"] = (False, lambda h, t, i, b, g, a, p: chunked.cut_bce_weighted_sum(
            h, t, i, b, g, label_smoothing=a, pos_weight=p, chunk_size=CHUNK))
    return kernels


def _reference_kernel(h, t, i, b, g, a, p):
    from keras_cutbce.math import reference

    return reference.cut_bce(h, t, i, b, label_smoothing=a, pos_weight=p)


KERNEL_NAMES = sorted(_kernels()) + ["reference"]
# Interpreted Pallas is slow: two cases of each test keep the file fast.
EXACT_CASES = [
    (name, a, p) for name in KERNEL_NAMES for a, p in CASES
    if name != "pallas" or (a, p) in CASES[:2]
]
KERAS_CASES = [
    pytest.param(name, a, marks=pytest.mark.slow) if name == "pallas" else (name, a)
    for name in KERNEL_NAMES for a in (0.0, 0.1) if name != "pallas" or a == 0.0
]


def _run(name, a, p):
    hidden, table, bias, ids, g = _problem()
    per_row, fn = (True, _reference_kernel) if name == "reference" else _kernels()[name]
    ids_t = keras.ops.convert_to_tensor(ids.astype("int32"))
    g_t = keras.ops.convert_to_tensor(g)
    if per_row:
        loss = to_numpy(fn(*(keras.ops.convert_to_tensor(x) for x in (hidden, table)), ids_t,
                           keras.ops.convert_to_tensor(bias), g_t, a, p))

        def objective(h, t, b):
            return keras.ops.sum(g_t * fn(h, t, ids_t, b, g_t, a, p))
    else:
        loss = None

        def objective(h, t, b):
            return fn(h, t, ids_t, b, g_t, a, p)

    value, grads = value_and_grads(objective, hidden, table, bias)
    return loss, value, grads


def _assert_close(got, want, rtol, atol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    assert not bad.any(), (
        f"{what}: max error {err.max():.3g} at {np.argwhere(bad)[:3].tolist()}: "
        f"got {got[bad][:3]}, want {want[bad][:3]}"
    )


@pytest.mark.parametrize("name,a,p", EXACT_CASES)
@pytest.mark.slow
def test_exact_against_float64(name, a, p):
    hidden, _, _, ids, g = _problem()
    want_loss, want_dh, want_dt, want_db = _float64_oracle(hidden, ids, g, a, p)
    loss, value, (dh, dt, db) = _run(name, a, p)
    # Float32 resolution of each value; below float32's smallest normal
    # number (the row of true loss 3.7e-44) XLA and TF may flush to zero.
    if loss is not None:
        _assert_close(loss, want_loss, 2e-6, TINY, "loss")
    _assert_close(value, np.dot(g, want_loss), 2e-6, TINY, "weighted sum")
    # d hidden = dz exactly (identity table): each entry to float32 precision,
    # the positives' -sigmoid(-z) of 1e-8 .. 1e-13 included.
    _assert_close(dh, want_dh, 1e-5, TINY, "grad hidden")
    # Table and bias gradients sum over rows (some cancel): float32
    # resolution of the largest entry.
    _assert_close(dt, want_dt, 1e-5, 1e-7 * np.abs(want_dt).max(), "grad table")
    _assert_close(db, want_db, 1e-5, 1e-7 * np.abs(want_db).max(), "grad bias")


@pytest.mark.parametrize("name,a", KERAS_CASES)
def test_matches_keras_dense_binary_crossentropy(name, a):
    from keras_cutbce.math import reference

    hidden, table, bias, ids, g = _problem()
    multi_hot = reference.multi_hot(keras.ops.convert_to_tensor(ids.astype("int32")), VOCAB)
    g_t = keras.ops.convert_to_tensor(g)

    def keras_objective(h, t, b):
        z = reference.logits(h, t, b)
        loss = keras.losses.binary_crossentropy(multi_hot, z, from_logits=True, label_smoothing=a)
        return keras.ops.sum(g_t * loss)

    want_value, want_grads = value_and_grads(keras_objective, hidden, table, bias)
    _, value, grads = _run(name, a, 1.0)
    _assert_close(value, want_value, 1e-6, TINY, "weighted sum vs Keras")
    # Keras's own gradient is `sigmoid(z) - y` on some backends (0 at z > 17),
    # so the comparison allows float32 resolution of the largest gradient.
    for got, want, what in zip(grads, want_grads, ("hidden", "table", "bias")):
        scale = np.abs(want).max()
        _assert_close(got, want, 1e-5, 2e-7 * scale, f"grad {what} vs Keras")
