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


def _targets(ids, vocab=V):
    """`multi_hot(ids) / |P|` (float32 `[M, vocab]`) and each position's count of valid ids."""
    hot = np.zeros((len(ids), vocab), np.float32)
    for row, row_ids in enumerate(ids):
        for i in row_ids:
            if 0 <= i < vocab:
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


@pytest.mark.parametrize("implementation", ["reference"] + [
    pytest.param(k, marks=pytest.mark.slow) if k != "chunked" else k for k in KERNELS])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_items_with_a_bias_of_minus_inf(label_smoothing, implementation):
    """Items masked by a `-inf` bias (two whole tiles, the first included, and the item padding
    ids fall on): probability 0 and no gradient; a target at `-inf` gives `+inf`, and so does
    any smoothing (`a / V` on every item), as Keras's dense loss; padding adds nothing."""
    hidden, table, bias = _inputs(seed=9)
    bias[:8], bias[16:24], bias[3] = -np.inf, -np.inf, 0.5
    ids = np.array([[3, -1], [0, -1], [-1, -1], [36, 3], [5, 40]])  # 0, 5: masked targets
    weights = np.array([1.0, 0.5, 2.0, 0.25, 1.5], np.float32)

    def cut(h, e, b):
        per_row = cut_categorical_crossentropy(h, e, ids, b, label_smoothing=label_smoothing,
                                               chunk_size=TILE, implementation=implementation)
        return ops.sum(ops.convert_to_tensor(weights) * ops.where(ops.isfinite(per_row), per_row, 0.0))

    loss = to_numpy(cut_categorical_crossentropy(hidden, table, ids, bias,
                                                 label_smoothing=label_smoothing, chunk_size=TILE,
                                                 implementation=implementation))
    _, grads = value_and_grads(cut, hidden, table, bias)
    want, want_grads = _float64(hidden, table, bias, ids, label_smoothing, weights)
    assert np.isposinf(want[[1, 4]]).all() and want[2] == 0.0
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-5)  # inf where the float64 is
    # Keras's +inf rows are ours (its other rows: NaN from `0 * -inf`, or the float64 value).
    keras_loss = to_numpy(_keras_loss(hidden, table, bias, ids, label_smoothing))
    assert np.isposinf(loss[np.isposinf(keras_loss)]).all()
    if label_smoothing:
        assert np.isposinf(want[[0, 3]]).all()  # no finite row to differentiate
        return
    finite = np.isfinite(want)
    weights[~finite] = 0.0
    _, want_grads = _float64(hidden, table, bias, ids, 0.0, weights)
    for name, got, w in zip(("hidden", "table", "bias"), grads, want_grads):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.all(grads[1][np.isneginf(bias)] == 0) and np.all(grads[2][np.isneginf(bias)] == 0)


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


def test_config_round_trip_and_kernels():
    _, table, _ = _inputs()
    loss = CutSoftmaxLoss(table, label_smoothing=0.2, chunk_size=16, reduction="sum", name="sm")
    config = loss.get_config()
    assert config["label_smoothing"] == 0.2 and "pos_weight" not in config
    again = CutSoftmaxLoss.from_config(config)
    assert (again.label_smoothing, again.chunk_size, again.reduction, again.name) == (
        0.2, 16, "sum", "sm")
    assert keras.saving.get_registered_object("keras_cutbce>CutSoftmaxLoss") is CutSoftmaxLoss
    kernel = {"jax": "pallas", "torch": "triton"}.get(BACKEND)
    if kernel is not None:  # the kernels take it (test_pallas.py, test_triton_parity.py)
        assert CutSoftmaxLoss(table, implementation=kernel).implementation == kernel


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
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs_are_as_exact_as_the_dense_low_precision_loss(dtype, label_smoothing,
                                                                           implementation):
    """bfloat16 / float16 hidden, table and bias (the mixed policies'): float32 accumulation inside."""
    from tests.backend_utils import assert_within_low_precision

    ids = IDS["multi"]
    hidden, table, bias = (ops.cast(x, dtype) for x in _inputs(seed=5, scale=2.0))
    weights = np.array([1.0, 0.5, 2.0, 0.25, 1.5], np.float32)
    w = ops.convert_to_tensor(weights)

    def cut(h, e, b):
        return ops.sum(w * cut_categorical_crossentropy(h, e, ids, b, label_smoothing=label_smoothing,
                                                        chunk_size=TILE,
                                                        implementation=implementation))

    def dense(h, e, b):  # Keras's loss on the low-precision logits
        return ops.sum(ops.cast(_keras_loss(h, e, b, ids, label_smoothing), "float32") * w)

    value, grads = value_and_grads(cut, hidden, table, bias)
    low_value, low_grads = value_and_grads(dense, hidden, table, bias)
    loss64, grads64 = _float64(*(to_numpy(x) for x in (hidden, table, bias)), ids, label_smoothing,
                               weights)
    assert_within_low_precision(value, low_value, np.sum(weights * loss64), "loss")
    for name, got, low, want in zip(("hidden", "table", "bias"), grads, low_grads, grads64):
        assert_within_low_precision(got, low, want, f"d{name}")


def _torch_peer(peer, hidden, table, bias, target, **kwargs):
    """PyTorch's loss on `hidden @ table.T + bias` (`cross_entropy`) or without the logits."""
    import torch.nn as nn
    import torch.nn.functional as F

    if peer == "cross_entropy":
        return F.cross_entropy(hidden @ table.T + bias, target, **kwargs)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=8) if peer.endswith("chunked") else None
    return F.linear_cross_entropy(hidden, table, target, linear_bias=bias, options=options, **kwargs)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's own losses")
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("peer", ["cross_entropy", "linear_cross_entropy",
                                  "linear_cross_entropy_chunked"])
def test_matches_torch_with_ignore_index(peer, reduction, label_smoothing):
    """PyTorch's `cross_entropy` and `linear_cross_entropy` (reference and chunked paths):
    loss and gradients of hidden, table and bias, padding ids as `ignore_index`.

    Where the semantics differ: PyTorch's `"mean"` divides by the targets not ignored;
    Keras's `"sum_over_batch_size"` by every position (a padding position is a zero-weight
    one). PyTorch's mean is Keras's `"mean_with_sample_weight"` with the valid mask as weight.
    """
    import torch

    if peer.endswith("chunked") and label_smoothing:
        pytest.skip("PyTorch's chunked path has no label smoothing (it falls back to the reference)")
    hidden, table, bias = (torch.tensor(x) for x in _inputs(seed=6, scale=3.0, rows=13))
    target = torch.tensor([3, -1, 36, 0, -1, 5, 5, 17, 36, 1, -1, 2, 30])
    valid = (target >= 0).to(torch.float32)

    def ours(h, e, b):
        kwargs = {"label_smoothing": label_smoothing, "chunk_size": TILE}
        if reduction == "mean":
            loss = CutSoftmaxLoss(e, b, reduction="mean_with_sample_weight", **kwargs)
            return loss(target, h, sample_weight=valid)
        return CutSoftmaxLoss(e, b, reduction=reduction, **kwargs)(target, h)

    def theirs(h, e, b):
        return _torch_peer(peer, h, e, b, target, ignore_index=-1, reduction=reduction,
                           label_smoothing=label_smoothing)

    def scalar(fn):
        return lambda h, e, b: (fn(h, e, b) * torch.arange(1.0, 14.0)).sum() if (
            reduction == "none") else fn(h, e, b)

    value, grads = value_and_grads(scalar(ours), hidden, table, bias)
    want, want_grads = value_and_grads(scalar(theirs), hidden, table, bias)
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5)
    for name, got, w in zip(("hidden", "table", "bias"), grads, want_grads):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5, err_msg=name)
    if reduction == "mean":  # Keras's default divides by all 13 positions, PyTorch by the 10 valid
        keras_mean = CutSoftmaxLoss(table, bias, label_smoothing=label_smoothing)(target, hidden)
        np.testing.assert_allclose(to_numpy(keras_mean) * 13 / 10, want, rtol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's own cross_entropy")
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_several_ids_are_torch_cross_entropy_of_probability_targets(label_smoothing):
    """`cross_entropy` with class probabilities `multi_hot / |P|` is the multi-id loss; it
    differs only at a position without a valid id (PyTorch: the smoothing's `a * mean(-log p)`
    on an all-zero target; here padding, loss 0)."""
    import torch
    import torch.nn.functional as F

    hidden, table, bias = _inputs(seed=8, scale=2.0)
    y, count = _targets(IDS["multi"])
    got = to_numpy(cut_categorical_crossentropy(hidden, table, IDS["multi"], bias,
                                                label_smoothing=label_smoothing, chunk_size=TILE))
    z = torch.tensor(hidden @ table.T + bias)
    want = F.cross_entropy(z, torch.tensor(y), reduction="none", label_smoothing=label_smoothing)
    np.testing.assert_allclose(got[count > 0], to_numpy(want)[count > 0], rtol=1e-5, atol=1e-5)
    assert got[2] == 0.0 and (label_smoothing == 0.0) == (float(want[2]) == 0.0)


@pytest.mark.skipif(BACKEND != "torch", reason="the torch tile loop's passes")
def test_torch_fused_path_computes_the_loss_once(monkeypatch):
    """Two passes over the tiles: the statistics (and the loss), then the gradients alone."""
    import torch

    from keras_cutbce.backends.torch import chunked

    passes = []
    real = chunked.tile_pass

    def recorded(*args, loss, **kwargs):
        passes.append(loss)
        return real(*args, loss=loss, **kwargs)

    monkeypatch.setattr(chunked, "tile_pass", recorded)
    hidden, table, bias = (torch.tensor(x, requires_grad=True) for x in _inputs(seed=7))
    ids = torch.tensor([[3], [-1], [36], [0], [5]])
    weights = torch.ones(5)
    total = chunked.cut_softmax_weighted_sum(hidden, table, ids, bias, weights, label_smoothing=0.1,
                                             chunk_size=TILE)
    per_row = chunked.cut_softmax(hidden, table, ids, bias, label_smoothing=0.1, chunk_size=TILE)
    assert passes == [True, False, True]  # fused: statistics, gradients; per row: the loss
    torch.testing.assert_close(total, per_row.sum(), rtol=1e-6, atol=1e-6)


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


_FLOAT64_STEP = {}


@pytest.mark.slow
@pytest.mark.parametrize("policy,users", [("mixed_bfloat16", False), ("mixed_float16", False)] + [
    (policy, True) for policy in ("float32", "mixed_bfloat16", "mixed_float16")])
def test_first_fit_step_under_mixed_precision_matches_dense_keras(policy, users):
    """One SGD step of `fit` under the policy (under `mixed_float16`, through Keras's loss
    scaling) against float64: the loss and every weight's change no worse than twice the
    dense Keras model's (`CategoricalCrossentropy` on the logits) under the same policy.

    `users`: `test_loss.users_model` (towers, `DetachBlock`s, regularizer, batch norm,
    dropout). Its many small biases move by less than their low-precision rounding, so under
    a mixed policy the bound is ERASE's (`assert_like_the_standard_step`): the worst weight's
    error relative to its float64 move, at most twice the dense model's worst."""
    from tests.cutbce.test_loss import assert_step_like_dense, first_step, fit_data

    vocab, dim = 53, 8
    x, y = fit_data(vocab)
    cut = first_step(vocab, dim, x, y, policy, softmax=True, users=users)
    dense = first_step(vocab, dim, x, y, policy, dense=True, softmax=True, users=users)
    if users not in _FLOAT64_STEP:  # one float64 step for every policy
        _FLOAT64_STEP[users] = first_step(vocab, dim, x, y, "float64", softmax=True, users=users)
    assert_step_like_dense(cut, dense, _FLOAT64_STEP[users], whole_model=users and policy != "float32")


# Keras's own test cases of `CategoricalCrossentropy` and `SparseCategoricalCrossentropy`
# (keras/src/losses/losses_test.py) that take logits, through the identity table
# (hidden = the logits, embeddings = I): (logits, ids, call and loss arguments, Keras's number).
_LOGITS = [[8.0, 1.0, 1.0], [0.0, 9.0, 1.0], [2.0, 3.0, 5.0]]
_CORRECT = [[10.0, 0.0, 0.0], [0.0, 10.0, 0.0], [0.0, 0.0, 10.0]]
_WEIGHTS = [[1.2], [3.4], [5.6]]
_IGNORED = [[[0.854, 0.698, 0.598], [0.088, 0.86, 0.018]]]
KERAS_CASES = {
    "all_correct_unweighted": (_CORRECT, [[0], [1], [2]], {}, 0.0),
    "unweighted": (_LOGITS, [[0], [1], [2]], {}, 0.0573),
    "sparse_unweighted": (_LOGITS, [0, 1, 2], {}, 0.0573),
    "scalar_weighted": (_LOGITS, [[0], [1], [2]], {"sample_weight": 2.3}, 0.1317),
    "sample_weighted": (_LOGITS, [[0], [1], [2]], {"sample_weight": _WEIGHTS}, 0.31829),
    "no_reduction": (_LOGITS, [[0], [1], [2]], {"reduction": None}, [0.001822, 0.000459, 0.169846]),
    "label_smoothing": ([[100.0, -100.0, -100.0]], [[0]], {"label_smoothing": 0.1}, 400 * 0.1 / 3),
    "ignore_class": (_IGNORED, [[-1, 2]], {"reduction": None}, [[0.0, 1.480129]]),
    "ignore_class_ids_last_axis": (_IGNORED, [[[-1], [2]]], {"reduction": None}, [[0.0, 1.480129]]),
}


@pytest.mark.parametrize("name", sorted(KERAS_CASES))
def test_keras_categorical_crossentropy_cases_through_the_identity_table(name):
    """Keras's number (to its 3 decimals) and Keras's loss class on the logits (to float32).

    Not ported, as they do not apply: the cases on probabilities (`from_logits=False`: the
    loss takes hidden states, its logits are `h @ E.T`), `axis` other than -1 and the
    segmentation cases (probabilities, a class axis), `shape_mismatch` (one-hot `y_true`:
    the targets here are ids). `ignore_class=-1` is a padding id here. The config and dtype
    cases: `test_config_round_trip_and_unimplemented_kernels` and the dtype case below.
    """
    logits, ids, kwargs, want = KERAS_CASES[name]
    logits, ids = np.array(logits, "float32"), np.array(ids)
    call = {"sample_weight": kwargs.pop("sample_weight")} if "sample_weight" in kwargs else {}
    call = {k: np.array(v, "float32") if isinstance(v, list) else v for k, v in call.items()}
    got = to_numpy(CutSoftmaxLoss(np.eye(3, dtype="float32"), **kwargs)(ids, logits, **call))
    np.testing.assert_allclose(got, np.array(want), atol=1e-3)
    if name.startswith("ignore_class"):
        keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1,
                                                                **kwargs)
        keras_value = keras_loss(ids, logits)
    else:
        hot, _ = _targets(ids.reshape(len(logits), -1), vocab=3)
        keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, **kwargs)
        keras_value = keras_loss(hot, logits, **call)
    np.testing.assert_allclose(got, to_numpy(keras_value), rtol=1e-5, atol=1e-6)


def test_keras_dtype_case():
    """Keras's `test_dtype_arg`: the reduced loss in the loss's `dtype`."""
    loss = CutSoftmaxLoss(np.eye(3, dtype="float32"), dtype="bfloat16")
    value = loss(np.array([[0], [1], [2]]), np.eye(3, dtype="float32"))
    assert keras.backend.standardize_dtype(value.dtype) == "bfloat16"


@pytest.mark.parametrize("implementation", ["reference", "chunked"] + [
    pytest.param(k, marks=pytest.mark.slow) for k in KERNELS[1:]])
@pytest.mark.parametrize("family", ["softmax", "bce"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_hidden_state_shows_as_keras_shows_it(bad, family, implementation):
    """A NaN or infinite hidden row gives NaN, as Keras's dense loss does: with and without a valid
    target, per position and reduced (at weight 0 too); the other rows' losses and the gradients
    of the finite rows as with the broken rows at weight 0."""
    ids = IDS["multi"]  # row 2: no valid id
    hidden, table, bias = _inputs(scale=2.0)
    broken = hidden.copy()
    broken[2, 1] = broken[4, 0] = bad
    y, _ = _targets(ids)
    z = ops.matmul(broken, ops.transpose(table)) + ops.convert_to_tensor(bias)
    if family == "softmax":
        op, loss_class = cut_categorical_crossentropy, CutSoftmaxLoss
        keras_rows = keras.losses.categorical_crossentropy(y, z, from_logits=True)
    else:
        op, loss_class = keras_cutbce.cut_binary_crossentropy, keras_cutbce.CutBCELoss
        keras_rows = keras.losses.binary_crossentropy((y > 0).astype("float32"), z, from_logits=True)
    assert np.isnan(to_numpy(keras_rows)[[2, 4]]).all()
    kwargs = dict(chunk_size=TILE, implementation=implementation)
    got = to_numpy(op(broken, table, ids, bias, **kwargs))
    clean = to_numpy(op(hidden, table, ids, bias, **kwargs))
    assert np.isnan(got[[2, 4]]).all(), got
    np.testing.assert_array_equal(got[[0, 1, 3]], clean[[0, 1, 3]])
    weights = np.array([1.0, 0.5, 0.0, 0.25, 1.5], np.float32)
    for reduction in ("sum", "sum_over_batch_size"):
        total = loss_class(table, bias, reduction=reduction, **kwargs)(ids, broken, sample_weight=weights)
        assert np.isnan(to_numpy(total)), (reduction, total)

    finite = np.array([1.0, 0.5, 0.0, 0.25, 0.0], np.float32)

    def weighted(h):
        return ops.sum(ops.convert_to_tensor(finite) * op(h, table, ids, bias, **kwargs))

    _, (got_grad,) = value_and_grads(weighted, broken)
    _, (want_grad,) = value_and_grads(weighted, hidden)
    np.testing.assert_allclose(got_grad[[0, 1, 3]], want_grad[[0, 1, 3]], rtol=1e-6, atol=1e-7)
