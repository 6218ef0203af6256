"""Keras's own `BinaryCrossentropy` and `Loss` test cases, run through `CutBCELoss`.

Keras is the spec: each case of `keras/src/losses/losses_test.py`
(`BinaryCrossentropyTest`) and `keras/src/losses/loss_test.py` (reductions,
masks, sample weights, rank adjustment) is mapped onto CutBCE with an identity
table: the hidden states are the logits and the table is `eye(V)`, so
`hidden @ table.T` equals the logits Keras is given, and the multi-hot targets
become id lists padded with -1. Expected values are Keras's constants, or
Keras's `BinaryCrossentropy(from_logits=True)` run side by side on the same
dense logits, weights and masks.
"""

import re

import keras
import numpy as np
import pytest
from keras import ops
from keras.src.backend.common.masking import set_keras_mask

from keras_cutbce import CutBCELoss
from tests.backend_utils import BACKEND, to_numpy

REDUCTIONS = ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none", None]


def identity_case(multi_hot, logits):
    """`(ids, hidden, table)` for CutBCE equal to Keras BCE on `(multi_hot, logits)`."""
    multi_hot = np.asarray(multi_hot)
    vocab = multi_hot.shape[-1]
    flat = multi_hot.reshape(-1, vocab)
    ids = np.full(flat.shape, -1, "int32")
    for row, hot in enumerate(flat):
        on = np.flatnonzero(hot)
        ids[row, : len(on)] = on
    ids = ids.reshape(multi_hot.shape)
    return ids, np.asarray(logits, "float32"), np.eye(vocab, dtype="float32")


def cut_loss(multi_hot, logits, sample_weight=None, mask=None, **kwargs):
    ids, hidden, table = identity_case(multi_hot, logits)
    hidden = ops.convert_to_tensor(hidden)
    if mask is not None:
        set_keras_mask(hidden, ops.convert_to_tensor(mask))
    loss = CutBCELoss(keras.Variable(table), chunk_size=2, **kwargs)
    return loss(ids, hidden, sample_weight=sample_weight)


def keras_loss(multi_hot, logits, sample_weight=None, mask=None, **kwargs):
    if mask is not None and sample_weight is not None:
        # Keras merges the mask into the weight *in place* (`sample_weight *=
        # float_mask`), which fails on torch when the weight is smaller than
        # the mask; the merged weight has the mask's shape on every backend,
        # so give Keras the weight broadcast to it (the same numbers).
        sample_weight = np.asarray(sample_weight, "float32")
        if sample_weight.ndim == np.ndim(mask) + 1 and sample_weight.shape[-1] == 1:
            sample_weight = sample_weight[..., 0]
        sample_weight = sample_weight.reshape(
            sample_weight.shape + (1,) * (np.ndim(mask) - sample_weight.ndim)
        )
        sample_weight = np.broadcast_to(sample_weight, np.shape(mask)).copy()
    logits = ops.convert_to_tensor(np.asarray(logits, "float32"))
    if mask is not None:
        set_keras_mask(logits, ops.convert_to_tensor(mask))
    loss = keras.losses.BinaryCrossentropy(from_logits=True, **kwargs)
    return loss(np.asarray(multi_hot, "float32"), logits, sample_weight=sample_weight)


# -- keras/src/losses/losses_test.py: BinaryCrossentropyTest, logits cases ----------

Y = np.array([[1, 0, 1], [0, 1, 1]])
Z = np.array([[10.0, -10.0, 10.0], [10.0, 10.0, -10.0]])


def test_all_correct_unweighted():
    y = np.eye(3)
    z = np.where(y > 0, 10.0, -10.0)
    assert float(to_numpy(cut_loss(y, z))) == pytest.approx(0.0, abs=1e-3)


def test_unweighted():
    assert float(to_numpy(cut_loss(Y, Z))) == pytest.approx(3.3333, abs=1e-3)


def test_scalar_weighted():
    assert float(to_numpy(cut_loss(Y, Z, sample_weight=2.3))) == pytest.approx(7.666, abs=1e-3)


@pytest.mark.parametrize("shape", [(2,), (2, 1)])
def test_sample_weighted(shape):
    """Keras's `test_sample_weighted`: `[B]` and `[B, 1]` weights for `[B]` losses."""
    weights = np.array([4.0, 3.0]).reshape(shape)
    assert float(to_numpy(cut_loss(Y, Z, sample_weight=weights))) == pytest.approx(10.0, abs=1e-3)


def test_no_reduction():
    np.testing.assert_allclose(to_numpy(cut_loss(Y, Z, reduction=None)), [0.0, 6.666], atol=1e-3)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_trailing_unit_weight_axis_has_keras_shape(reduction):
    """A `[B, 1]` weight for `[B]` losses: Keras's value and shape (`(2, 1)` unreduced), not `[B, B]`."""
    weights = np.array([[1.2], [3.4]], "float32")
    ours = to_numpy(cut_loss(Y, Z, sample_weight=weights, reduction=reduction))
    theirs = to_numpy(keras_loss(Y, Z, sample_weight=weights, reduction=reduction))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_label_smoothing():
    z = np.array([[10.0, -10.0, -10.0]])
    y = np.array([[1, 0, 1]])
    got = float(to_numpy(cut_loss(y, z, label_smoothing=0.1)))
    assert got == pytest.approx((10.0 + 5.0 * 0.1) / 3.0, abs=1e-3)


# -- keras/src/losses/loss_test.py cases, and every reduction x weight x mask shape ------


def sequence_case(seed=0, batch=3, steps=4, vocab=6):
    rng = np.random.default_rng(seed)
    y = (rng.uniform(size=(batch, steps, vocab)) < 0.3).astype("float32")
    z = rng.normal(size=(batch, steps, vocab)).astype("float32") * 3
    return y, z


WEIGHT_SHAPES = {
    "none": None,
    "scalar": (),
    "per_example_b1": (3, 1),  # [B, 1] over [B, T] losses
    "per_position": (3, 4),
    "per_position_t1": (3, 4, 1),  # [B, T, 1] over [B, T] losses
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weights", list(WEIGHT_SHAPES))
@pytest.mark.parametrize("masked", [False, True])
def test_every_reduction_weight_shape_and_mask_matches_keras(reduction, weights, masked):
    y, z = sequence_case()
    shape = WEIGHT_SHAPES[weights]
    rng = np.random.default_rng(1)
    sw = None if shape is None else rng.uniform(0.1, 2.0, size=shape).astype("float32")
    mask = None
    if masked:
        mask = np.ones(z.shape[:2], bool)
        mask[0, 2:] = False
        mask[2, 1:] = False
    ours = to_numpy(cut_loss(y, z, sample_weight=sw, mask=mask, reduction=reduction))
    theirs = to_numpy(keras_loss(y, z, sample_weight=sw, mask=mask, reduction=reduction))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)


def test_per_example_weight_without_trailing_axis_is_per_example():
    """`[B]` weights over `[B, T]` losses mean one weight per example (Keras's `[B, 1]`)."""
    y, z = sequence_case()
    sw = np.array([0.5, 1.0, 2.0], "float32")
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight", None):
        ours = to_numpy(cut_loss(y, z, sample_weight=sw, reduction=reduction))
        theirs = to_numpy(keras_loss(y, z, sample_weight=sw[:, None], reduction=reduction))
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("uprank", ["mask", "sample_weight", "ys"])
def test_rank_adjustment(uprank):
    """Keras's `test_rank_adjustment`: a trailing size-1 axis on the mask, weights or ys."""
    rng = np.random.default_rng(3)
    sample_weight = np.array([0.4, 0.3, 0.2, 0.1], "float32")
    y = (rng.uniform(size=(4, 5)) < 0.4).astype("float32")
    z = rng.normal(size=(4, 5)).astype("float32")
    mask = np.array([True, False, True, True])
    if uprank == "mask":
        mask = mask[:, None]
    elif uprank == "sample_weight":
        sample_weight = sample_weight[:, None]
    else:
        y, z = y[:, None], z[:, None]
    ours = cut_loss(y, z, sample_weight=sample_weight, mask=mask)
    theirs = keras_loss(y, z, sample_weight=sample_weight, mask=mask)
    assert keras.backend.standardize_dtype(ours.dtype) == "float32"
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), rtol=2e-5)
    # Keras's expected value: the masked rows' weighted mean over the 3 valid rows.
    y2, z2 = y.reshape(4, 5), z.reshape(4, 5)
    per_row = np.mean(np.logaddexp(0, z2) - y2 * z2, axis=-1)
    keep = [0, 2, 3]
    want = np.sum(np.array([0.4, 0.3, 0.2, 0.1])[keep] * per_row[keep]) / 3
    assert float(to_numpy(ours)) == pytest.approx(want, rel=1e-5)


def test_everything_masked_or_zero_weights_gives_zero_not_nan():
    y, z = sequence_case()
    mask = np.zeros(z.shape[:2], bool)
    assert float(to_numpy(cut_loss(y, z, mask=mask))) == 0.0
    zero = np.zeros(z.shape[:2], "float32")
    assert float(to_numpy(cut_loss(y, z, sample_weight=zero))) == 0.0
    assert float(to_numpy(cut_loss(y, z, sample_weight=zero, reduction="mean_with_sample_weight"))) == 0.0


@pytest.mark.parametrize("shape", [(4,), (3, 5), (3, 4, 2), (2, 1)])
def test_sample_weight_of_a_wrong_shape_names_both_shapes(shape):
    """A clear error naming `sample_weight` and both shapes, not a backend error."""
    y, z = sequence_case()
    sw = np.ones(shape, "float32")
    for reduction in ("sum_over_batch_size", None):
        with pytest.raises(ValueError, match=r"sample_weight.*\(3, 4\).*" + re.escape(str(shape))):
            cut_loss(y, z, sample_weight=sw, reduction=reduction)



# -- TensorFlow, unknown batch size ------------------------------------------------


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function only on TensorFlow")
@pytest.mark.slow
def test_tf_function_unknown_batch_with_sample_weight():
    import tensorflow as tf

    y, z = sequence_case()
    ids, hidden, table = identity_case(y, z)
    # One more padding column: in a compiled step ids with L == V read as multi-hot labels by their shape.
    ids = np.pad(ids, [(0, 0), (0, 0), (0, 1)], constant_values=-1)
    sw = np.random.default_rng(0).uniform(size=(3, 1)).astype("float32")
    for reduction in ("none", "sum_over_batch_size", "mean_with_sample_weight"):
        loss = CutBCELoss(keras.Variable(table), reduction=reduction, chunk_size=2)

        @tf.function(input_signature=[
            tf.TensorSpec((None, 4, 7), tf.int32),
            tf.TensorSpec((None, 4, 6), tf.float32),
            tf.TensorSpec((None, 1), tf.float32),
        ])
        def call(i, h, w, loss=loss):
            return loss(i, h, sample_weight=w)

        got = to_numpy(call(ids, hidden, sw))
        want = to_numpy(keras_loss(y, z, sample_weight=sw, reduction=reduction))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "reduction",
    # Unreduced losses in `fit` are a TensorFlow feature (the tape sums them):
    # stock Keras losses with reduction="none" fail under jax.grad too.
    ["none", "sum_over_batch_size"] if BACKEND == "tensorflow" else ["sum_over_batch_size"],
)
def test_fit_with_sample_weight_and_unreduced_loss(reduction):
    """`fit` with `reduction="none"` and a sample weight (unknown batch on TF) trains."""
    vocab, dim = 13, 4
    rng = np.random.default_rng(0)
    items = keras.layers.Embedding(vocab, dim, name="items")
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(dim)(items(inputs)))
    model.compile(optimizer="sgd", loss=CutBCELoss(items, reduction=reduction, chunk_size=8))
    x = rng.integers(0, vocab, size=(16, 3))
    y = rng.integers(0, vocab, size=(16, 3, 2))
    history = model.fit(x, y, sample_weight=rng.uniform(size=(16,)), batch_size=5, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
