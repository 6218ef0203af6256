"""`cut_categorical_crossentropy` and `CutSoftmaxLoss` against Keras's softmax losses and float64.

The oracles: `keras.losses.categorical_crossentropy(y, z, from_logits=True,
label_smoothing=a)` on the dense logits (`y = multi_hot / |P|`), Keras's
loss classes for the reductions and sample weights, and the float64 rows of
`keras_cutbce.math.spec.softmax_row` (each position's loss and slopes, from
which the gradients of hidden, table and bias follow). Odd shapes: V = 37
with tiles of 8. Runs on every Keras backend.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_cutbce
from keras_cutbce import CutSoftmaxLoss, cut_categorical_crossentropy
from keras_cutbce.math import spec
from tests.backend_utils import BACKEND, to_numpy, value_and_grads, worst_row_error

V, D, TILE = 37, 6, 8
# The kernels of each backend beside the chunked loop (Pallas: interpreted off TPU, V = 37
# inside one 128-wide tile).
KERNELS = ["chunked"] + ["pallas"] * (BACKEND == "jax")
IDS = {
    # one id a position: sparse_categorical_crossentropy
    "single": np.array([[3], [0], [36], [17], [8]]),
    # several ids, duplicates, padding (-1, V, int range), a position without a valid id
    "multi": np.array([[1, 2, 2], [3, -1, 99], [-1, 37, -5], [36, 0, 5], [7, 7, 7]]),
}


def _inputs(seed=0, scale=1.0, rows=5):
    rng = np.random.default_rng(seed)
    hidden = (scale * rng.normal(size=(rows, D))).astype("float32")
    table = rng.normal(size=(V, D)).astype("float32")
    bias = rng.normal(size=(V,)).astype("float32")
    return hidden, table, bias


def _targets(ids):
    """`multi_hot(ids) / |P|` (float32 `[M, V]`) and each position's count of valid ids."""
    hot = np.zeros((len(ids), V), np.float32)
    for row, row_ids in enumerate(ids):
        for i in row_ids:
            if 0 <= i < V:
                hot[row, i] = 1.0
    count = hot.sum(1)
    return hot / np.maximum(count, 1.0)[:, None], count


def _keras_loss(hidden, table, bias, ids, a):
    """Keras's per-position loss on the dense logits, 0 where no valid id (the contract)."""
    y, count = _targets(ids)
    z = ops.matmul(hidden, ops.transpose(table)) + bias
    loss = keras.losses.categorical_crossentropy(y, z, from_logits=True, label_smoothing=a)
    return ops.where(count > 0, loss, 0.0)


def _float64(hidden, table, bias, ids, a, weights):
    """The float64 loss `[M]` and the gradients of `sum(weights * loss)`."""
    h, e, b = (np.asarray(x, np.float64) for x in (hidden, table, bias))
    z = h @ e.T + b
    rows = [spec.softmax_row(z[m], [i for i in ids[m] if 0 <= i < V], a) for m in range(len(z))]
    loss = np.array([r[0] for r in rows])
    s = np.stack([r[1] for r in rows]) * np.asarray(weights, np.float64)[:, None]
    return loss, [s @ e, s.T @ h, s.sum(0)]


def _check(got, keras_value, want, what, floor=1e-5):
    """`got` as close to float64 `want` as Keras's float32 dense value is (or `floor`)."""
    error, keras_error = worst_row_error(got, want), worst_row_error(keras_value, want)
    assert error <= max(4.0 * keras_error, floor), f"{what}: {error:.3g} vs Keras {keras_error:.3g}"
    return error


@pytest.mark.parametrize("case,label_smoothing,path,implementation", [
    (case, a, path, "chunked") for case in sorted(IDS) for a in (0.0, 0.1) for path in ("op", "loss")
] + [pytest.param("multi", a, "loss", kernel, marks=pytest.mark.slow)
     for kernel in KERNELS[1:] for a in (0.0, 0.1)])
def test_loss_and_gradients_match_keras_and_float64(case, label_smoothing, path, implementation):
    ids = IDS[case]
    hidden, table, bias = _inputs(scale=2.0)
    weights = np.array([1.0, 0.5, 2.0, 0.25, 1.5], np.float32)

    def cut(h, e, b):
        if path == "op":
            per_row = cut_categorical_crossentropy(h, e, ids, b, label_smoothing=label_smoothing,
                                                   chunk_size=TILE, implementation=implementation)
            return ops.sum(ops.convert_to_tensor(weights) * per_row)
        loss = CutSoftmaxLoss(e, b, label_smoothing=label_smoothing, chunk_size=TILE,
                              implementation=implementation, reduction="sum")
        return loss(ids, h, sample_weight=weights)

    def dense(h, e, b):
        return ops.sum(ops.convert_to_tensor(weights) * _keras_loss(h, e, b, ids, label_smoothing))

    value, grads = value_and_grads(cut, hidden, table, bias)
    keras_value, keras_grads = value_and_grads(dense, hidden, table, bias)
    loss64, grads64 = _float64(hidden, table, bias, ids, label_smoothing, weights)
    _check(value, keras_value, np.sum(weights * loss64), "loss")
    for name, got, k, want in zip(("hidden", "table", "bias"), grads, keras_grads, grads64):
        _check(got, k, want, f"d{name}")
    per_row = to_numpy(cut_categorical_crossentropy(hidden, table, ids, bias,
                                                    label_smoothing=label_smoothing, chunk_size=TILE,
                                                    implementation=implementation))
    np.testing.assert_allclose(per_row, loss64, rtol=1e-5, atol=1e-5)
    if case == "multi":  # the position without a valid id: loss 0, no gradient
        assert per_row[2] == 0.0 and np.all(grads[0][2] == 0.0)


def test_one_id_a_position_is_sparse_categorical_crossentropy():
    hidden, table, bias = _inputs(seed=1)
    ids = np.array([3, 0, 36, 17, 8])
    got = cut_categorical_crossentropy(hidden, table, ids, bias, chunk_size=TILE)
    z = ops.matmul(hidden, ops.transpose(table)) + bias
    want = keras.losses.sparse_categorical_crossentropy(ids, z, from_logits=True)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", [pytest.param(k, marks=pytest.mark.slow)
                                            if k != "chunked" else k for k in KERNELS])
@pytest.mark.parametrize("label_smoothing", spec.SOFTMAX_SMOOTHING)
def test_spec_rows_through_the_identity_table(label_smoothing, implementation):
    """Saturated logits (|z| up to 1e3): the loss and slopes of each float64 spec row."""
    z = np.array([row for row, _ in spec.SOFTMAX_ROWS], np.float32)
    width = max(len(t) for _, t in spec.SOFTMAX_ROWS) or 1
    ids = np.array([list(t) + [-1] * (width - len(t)) for _, t in spec.SOFTMAX_ROWS])
    eye = np.eye(z.shape[1], dtype=np.float32)

    def total(h):
        return ops.sum(cut_categorical_crossentropy(h, eye, ids, label_smoothing=label_smoothing,
                                                    chunk_size=3, implementation=implementation))

    loss = to_numpy(cut_categorical_crossentropy(z, eye, ids, label_smoothing=label_smoothing,
                                                 chunk_size=3, implementation=implementation))
    _, (slopes,) = value_and_grads(total, z)
    for row, (logits, targets) in enumerate(spec.SOFTMAX_ROWS):
        want_loss, want_slopes = spec.softmax_row(logits, targets, label_smoothing)
        # float32: the log-sum-exp carries a rounding of `max |z|`, as in any float32 softmax
        scale = 4 * 2.0**-24 * (np.max(np.abs(logits)) + 1.0)
        assert abs(loss[row] - want_loss) <= scale + 4 * 2.0**-24 * abs(want_loss), row
        np.testing.assert_allclose(slopes[row], want_slopes, rtol=0, atol=scale)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean",
                                       "mean_with_sample_weight", "none"])
@pytest.mark.parametrize("weight_shape", [None, (2,), (2, 3)])
def test_reductions_and_sample_weights_match_keras(reduction, weight_shape):
    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(2, 3, D)).astype("float32")
    _, table, bias = _inputs(seed=2)
    ids = rng.integers(0, V, size=(2, 3, 2))
    ids[0, 1, 1] = -1
    weight = None if weight_shape is None else rng.uniform(0.1, 2, weight_shape).astype("float32")
    got = CutSoftmaxLoss(table, bias, label_smoothing=0.1, chunk_size=TILE, reduction=reduction)(
        ids, hidden, sample_weight=weight)
    y, _ = _targets(ids.reshape(-1, 2))
    z = ops.matmul(hidden, ops.transpose(table)) + bias
    keras_weight = weight[:, None] if weight_shape == (2,) else weight  # one a sequence
    want = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1,
                                                reduction=reduction)(
        y.reshape(2, 3, V), z, sample_weight=keras_weight)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=2e-6, atol=1e-6)


def test_config_round_trip_and_unimplemented_kernels():
    _, table, _ = _inputs()
    loss = CutSoftmaxLoss(table, label_smoothing=0.2, chunk_size=16, reduction="sum", name="sm")
    config = loss.get_config()
    assert config["label_smoothing"] == 0.2 and "pos_weight" not in config
    again = CutSoftmaxLoss.from_config(config)
    assert (again.label_smoothing, again.chunk_size, again.reduction, again.name) == (
        0.2, 16, "sum", "sm")
    assert keras.saving.get_registered_object("keras_cutbce>CutSoftmaxLoss") is CutSoftmaxLoss
    kernel = {"torch": "triton"}.get(BACKEND)
    if kernel is not None:
        with pytest.raises(NotImplementedError, match="softmax"):
            CutSoftmaxLoss(table, implementation=kernel)
        with pytest.raises(NotImplementedError, match="softmax"):
            cut_categorical_crossentropy(np.ones((2, D), "float32"), table, [[1], [2]],
                                         implementation=kernel)


def test_reference_implementation_matches_chunked():
    hidden, table, bias = _inputs(seed=3)
    ids = IDS["multi"]
    got = [to_numpy(cut_categorical_crossentropy(hidden, table, ids, bias, label_smoothing=0.1,
                                                 chunk_size=TILE, implementation=impl))
           for impl in ("chunked", "reference")]
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-6)


def test_fit_trains_the_table_through_the_loss():
    """One SGD step of `fit`: the table moves by `-lr` times Keras's dense gradient."""
    rng = np.random.default_rng(4)
    keras.utils.set_random_seed(4)
    items = keras.layers.Embedding(V, D, name="items")
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(D, name="project")(items(inputs)))
    x = rng.integers(0, V, size=(4, 3))
    y = rng.integers(0, V, size=(4, 3, 2))
    table, kernel, offset = (to_numpy(v) for v in (items.embeddings, *model.get_layer("project").weights))

    def dense(e, k, c):
        hidden = ops.matmul(ops.take(e, x, axis=0), k) + c
        targets, _ = _targets(y.reshape(-1, 2))
        z = ops.matmul(hidden, ops.transpose(e))
        return keras.losses.CategoricalCrossentropy(from_logits=True)(targets.reshape(4, 3, V), z)

    want_loss, (grad_table, _, _) = value_and_grads(dense, *(np.float32(a) for a in (table, kernel, offset)))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras_cutbce.CutSoftmaxLoss(items))
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]
    np.testing.assert_allclose(history[0], want_loss, rtol=1e-5)
    np.testing.assert_allclose(to_numpy(items.embeddings), table - 0.5 * grad_table, atol=1e-6)


@pytest.mark.parametrize("implementation", [pytest.param(k, marks=pytest.mark.slow)
                                            if k != "chunked" else k for k in KERNELS])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_bfloat16_inputs_are_as_exact_as_the_dense_bfloat16_loss(label_smoothing, implementation):
    """bfloat16 hidden, table and bias (mixed_bfloat16's): float32 accumulation inside."""
    from tests.backend_utils import assert_within_low_precision

    ids = IDS["multi"]
    hidden, table, bias = (ops.cast(x, "bfloat16") for x in _inputs(seed=5, scale=2.0))
    weights = np.array([1.0, 0.5, 2.0, 0.25, 1.5], np.float32)
    w = ops.convert_to_tensor(weights)

    def cut(h, e, b):
        return ops.sum(w * cut_categorical_crossentropy(h, e, ids, b, label_smoothing=label_smoothing,
                                                        chunk_size=TILE,
                                                        implementation=implementation))

    def dense(h, e, b):  # Keras's loss on bfloat16 logits
        return ops.sum(ops.cast(_keras_loss(h, e, b, ids, label_smoothing), "float32") * w)

    value, grads = value_and_grads(cut, hidden, table, bias)
    low_value, low_grads = value_and_grads(dense, hidden, table, bias)
    loss64, grads64 = _float64(*(to_numpy(x) for x in (hidden, table, bias)), ids, label_smoothing,
                               weights)
    assert_within_low_precision(value, low_value, np.sum(weights * loss64), "loss")
    for name, got, low, want in zip(("hidden", "table", "bias"), grads, low_grads, grads64):
        assert_within_low_precision(got, low, want, f"d{name}")


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's own cross_entropy")
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_matches_torch_cross_entropy_with_ignore_index(label_smoothing):
    import torch
    import torch.nn.functional as F

    hidden, table, bias = (torch.tensor(x) for x in _inputs(seed=6, scale=3.0))
    target = torch.tensor([3, -1, 36, 0, -1])
    got = cut_categorical_crossentropy(hidden, table, target, bias, label_smoothing=label_smoothing,
                                       chunk_size=TILE)
    want = F.cross_entropy(hidden @ table.T + bias, target, ignore_index=-1, reduction="none",
                           label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_item_embedding_bias_trains_through_the_loss():
    """An `ItemEmbedding(use_bias=True)`: the loss reads its bias, and `fit` moves it by Keras's gradient."""
    rng = np.random.default_rng(7)
    keras.utils.set_random_seed(7)
    items = keras_cutbce.ItemEmbedding(V, D, use_bias=True, name="items")
    inputs = keras.Input((2,), dtype="int32")
    model = keras.Model(inputs, items(inputs))
    x, y = rng.integers(0, V, size=(3, 2)), rng.integers(0, V, size=(3, 2))
    table, bias = to_numpy(items.embeddings), to_numpy(items.bias)

    def dense(e, b):
        z = ops.matmul(ops.take(e, x, axis=0), ops.transpose(e)) + b
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z)

    _, (_, grad_bias) = value_and_grads(dense, np.float32(table), np.float32(bias))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=CutSoftmaxLoss(items))
    model.fit(x, y, batch_size=3, epochs=1, verbose=0)
    np.testing.assert_allclose(to_numpy(items.bias), bias - 0.5 * grad_bias, atol=1e-6)
    assert np.abs(grad_bias).max() > 1e-3
