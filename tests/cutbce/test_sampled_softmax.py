"""`cut_sampled_softmax_crossentropy` and `SampledSoftmaxLoss` against a float64 oracle and TensorFlow.

The oracle (`_oracle`) is a per-row float64 NumPy loop giving the loss and
the gradients of hidden, table and bias; it is itself checked against
`tf.nn.sampled_softmax_loss` (values and gradients) with unique negatives.
Odd shapes: V = 37, D = 6, S = 9 negatives, rank-3 hidden. Runs on every
Keras backend.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_cutbce import SampledSoftmaxLoss, cut_sampled_softmax_crossentropy
from keras_cutbce import samplers
from keras_cutbce.math.sampled import SampledSoftmax, candidate_logits, sampled_softmax_loss
from keras_cutbce.math.positives import distinct_targets
from tests.backend_utils import assert_within_low_precision, to_numpy, value_and_grads
from tests.backend_utils import worst_row_error

V, D = 37, 6
# [2, 3, L=3] targets: duplicates, padding (-1, V, 99), a position without a valid id.
IDS = np.array([[[1, 2, 2], [3, -1, 99], [-1, 37, -5]], [[36, 0, 5], [7, 7, 7], [4, 11, -1]]])
# Repeated ids, padding, and ids that are targets of some position (accidental hits).
NEGATIVES = np.array([5, 2, 30, -1, 7, 30, 37, 12, 0])


def _inputs(seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    hidden = (scale * rng.normal(size=IDS.shape[:-1] + (D,)) / np.sqrt(D)).astype("float32")
    table = rng.normal(size=(V, D)).astype("float32")
    bias = rng.normal(size=(V,)).astype("float32")
    log_q = np.log(rng.dirichlet(np.ones(V))).astype("float32")
    return hidden, table, bias, log_q


def _oracle(hidden, table, bias, ids, negatives, log_q=None, negative_log_q=None, remove=True,
            temperature=1.0, weights=None):
    """Float64 `(loss [M], [d hidden, d table, d bias])` of `sum(weights * loss)`."""
    h = np.asarray(hidden, np.float64).reshape(-1, D)
    e, b = np.asarray(table, np.float64), np.asarray(bias, np.float64)
    ids = np.asarray(ids).reshape(len(h), -1)
    w = np.ones(len(h)) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    lq = None if log_q is None else np.asarray(log_q, np.float64)
    if negative_log_q is None and lq is not None:
        negative_log_q = [lq[n] if 0 <= n < V else 0.0 for n in negatives]
    loss, dh, de, db = np.zeros(len(h)), np.zeros_like(h), np.zeros_like(e), np.zeros_like(b)
    for m in range(len(h)):
        targets = sorted({int(i) for i in ids[m] if 0 <= i < V})
        if not targets:
            continue
        cand, shift = list(targets), [0.0 if lq is None else lq[t] for t in targets]
        for s, n in enumerate(negatives):
            if 0 <= n < V and not (remove and n in targets):
                cand.append(int(n))
                shift.append(0.0 if negative_log_q is None else float(negative_log_q[s]))
        z = (e[cand] @ h[m] + b[cand]) / temperature - np.array(shift)
        top = z.max()
        lse = top + np.log(np.exp(z - top).sum())
        y = np.zeros(len(cand))
        y[: len(targets)] = 1.0 / len(targets)
        loss[m] = lse - y @ z
        dz = w[m] * (np.exp(z - lse) - y) / temperature
        dh[m] = dz @ e[cand]
        np.add.at(de, cand, dz[:, None] * h[m])
        np.add.at(db, cand, dz)
    return loss, [dh.reshape(np.shape(hidden)), de, db]


# -- the oracle against TensorFlow --------------------------------------------------------


@pytest.mark.parametrize("num_true,remove,corrected", [(1, True, True), (2, True, True),
                                                       (2, False, False), (1, False, True)])
def test_oracle_matches_tensorflow_sampled_softmax_loss(num_true, remove, corrected):
    """Unique negatives, distinct targets (TF's domain): loss and the three gradients, float64."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    rows = 7
    hidden = rng.normal(size=(rows, D))
    table, bias = rng.normal(size=(V, D)), rng.normal(size=(V,))
    labels = np.stack([rng.choice(V, num_true, replace=False) for _ in range(rows)])
    negatives = rng.choice(V, 11, replace=False)
    log_q = np.log(rng.dirichlet(np.ones(V)))
    q = np.exp(log_q) if corrected else np.ones(V)
    h, e, b = (tf.constant(x, tf.float64) for x in (hidden, table, bias))
    with tf.GradientTape() as tape:
        tape.watch([h, e, b])
        theirs = tf.nn.sampled_softmax_loss(
            e, b, tf.constant(labels, tf.int64), h, num_sampled=len(negatives), num_classes=V,
            num_true=num_true, remove_accidental_hits=remove,
            sampled_values=(tf.constant(negatives, tf.int64), tf.constant(q[labels]),
                            tf.constant(q[negatives])))
        total = tf.reduce_sum(theirs)
    grads = tape.gradient(total, [h, e, b])
    grads = [tf.convert_to_tensor(g).numpy() for g in grads]
    loss, ours = _oracle(hidden, table, bias, labels, negatives,
                         log_q=log_q if corrected else None, remove=remove)
    np.testing.assert_allclose(loss, theirs.numpy(), rtol=1e-12, atol=1e-12)
    for got, want in zip(ours, grads):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_tensorflow_masks_one_occurrence_of_a_repeated_negative():
    """The documented difference: TF leaves a repeated accidental hit in; ours masks each occurrence."""
    import tensorflow as tf

    rng = np.random.default_rng(1)
    hidden, table, bias = rng.normal(size=(1, D)), rng.normal(size=(V, D)), np.zeros(V)
    negatives = np.array([4, 4, 9])
    ones = np.ones(3)
    theirs = tf.nn.sampled_softmax_loss(
        table, bias, tf.constant([[4]], tf.int64), hidden, num_sampled=3, num_classes=V,
        sampled_values=(tf.constant(negatives, tf.int64), tf.constant([1.0], tf.float64),
                        tf.constant(ones)))
    ours, _ = _oracle(hidden, table, bias, [[4]], negatives)
    once, _ = _oracle(hidden, table, bias, [[4]], negatives[1:], remove=False)  # one 4 left in
    assert abs(ours[0] - float(theirs[0])) > 1e-3
    np.testing.assert_allclose(once[0], float(theirs[0]), rtol=1e-10)


# -- the op on this backend ---------------------------------------------------------------


@pytest.mark.parametrize("remove,corrected,temperature", [(True, True, 1.0), (False, True, 1.0),
                                                          (True, False, 1.0), (True, True, 0.7)])
def test_op_loss_and_gradients_match_the_oracle(remove, corrected, temperature):
    hidden, table, bias, log_q = _inputs()
    weights = np.array([[1.0, 0.5, 2.0], [0.25, 1.5, 1.0]], np.float32)

    def ours(h, e, b):
        if temperature != 1.0:  # the loss class is the one door to the temperature
            loss = SampledSoftmaxLoss(e, 1, bias=b, seed=0, temperature=temperature,
                                      remove_accidental_hits=remove, reduction=None)
            return _with_negatives(loss, h, corrected, log_q, weights)
        per = cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES, b,
                                               log_q=log_q if corrected else None,
                                               remove_accidental_hits=remove)
        assert tuple(per.shape) == IDS.shape[:-1]
        return ops.sum(ops.convert_to_tensor(weights) * per)

    value, grads = value_and_grads(ours, hidden, table, bias)
    loss64, grads64 = _oracle(hidden, table, bias, IDS, NEGATIVES,
                              log_q=log_q if corrected else None, remove=remove,
                              temperature=temperature, weights=weights)
    np.testing.assert_allclose(value, np.sum(weights.reshape(-1) * loss64), rtol=2e-6)
    for name, got, want in zip(("hidden", "table", "bias"), grads, grads64):
        assert worst_row_error(got, want) < 2e-5, name
    assert loss64[2] == 0.0 and np.all(grads[0][0, 2] == 0.0)  # no valid target


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_hidden_state_shows_as_keras_shows_it(bad):
    """A NaN or infinite hidden state gives NaN, as Keras's dense loss does, also at the position
    without a valid target and reduced at weight 0; the other positions' losses and gradients as
    with the broken positions at weight 0."""
    hidden, table, bias, _ = _inputs()
    broken = hidden.copy()
    broken[0, 2, 1] = broken[1, 0, 0] = bad  # (0, 2): no valid target
    got = to_numpy(cut_sampled_softmax_crossentropy(broken, table, IDS, NEGATIVES, bias))
    clean = to_numpy(cut_sampled_softmax_crossentropy(hidden, table, IDS, NEGATIVES, bias))
    keep = np.ones(IDS.shape[:-1], bool)
    keep[0, 2] = keep[1, 0] = False
    assert np.isnan(got[~keep]).all(), got
    np.testing.assert_array_equal(got[keep], clean[keep])
    weights = keep.astype("float32")
    total = SampledSoftmaxLoss(table, 4, bias=bias, seed=0, reduction="sum")(IDS, broken, sample_weight=weights)
    assert np.isnan(to_numpy(total))

    def weighted(h):
        per = cut_sampled_softmax_crossentropy(h, table, IDS, NEGATIVES, bias)
        return ops.sum(ops.convert_to_tensor(weights) * per)

    _, (got_grad,) = value_and_grads(weighted, broken)
    _, (want_grad,) = value_and_grads(weighted, hidden)
    np.testing.assert_allclose(got_grad[keep], want_grad[keep], rtol=1e-6, atol=1e-7)


def _with_negatives(loss, h, corrected, log_q, weights):
    """`loss`'s per-position value with `NEGATIVES` as its draw (the op's inputs, through the class)."""
    from keras_cutbce import checks
    from keras_cutbce.sampled import _safe, _sampled_loss

    inputs = checks.loss_inputs(h, loss.embeddings, IDS, loss.bias)
    negatives = ops.convert_to_tensor(np.where(NEGATIVES < V, NEGATIVES, -1).astype("int32"))
    lq = ops.convert_to_tensor(log_q) if corrected else None
    neg = None if lq is None else ops.take(lq, _safe(negatives), axis=0)
    per = _sampled_loss(inputs, negatives, lq, neg, loss.remove_accidental_hits, loss.temperature)
    return ops.sum(ops.convert_to_tensor(weights.reshape(-1)) * ops.reshape(per, (-1,)))


def test_op_without_negatives_or_targets_and_with_one_id_a_position():
    hidden, table, bias, _ = _inputs(seed=2)
    empty = cut_sampled_softmax_crossentropy(hidden, table, IDS, np.zeros((0,), "int32"), bias)
    want, _ = _oracle(hidden, table, bias, IDS, [])
    np.testing.assert_allclose(to_numpy(empty).reshape(-1), want, rtol=1e-5, atol=1e-6)
    none = to_numpy(cut_sampled_softmax_crossentropy(hidden, table, np.full((2, 3), -1), NEGATIVES))
    assert np.all(none == 0.0)
    one = cut_sampled_softmax_crossentropy(hidden, table, IDS[..., 0], NEGATIVES, bias)
    want, _ = _oracle(hidden, table, bias, IDS[..., :1], NEGATIVES)
    np.testing.assert_allclose(to_numpy(one).reshape(-1), want, rtol=1e-5, atol=1e-6)


def test_dense_reference_and_gather_agree_through_the_registry():
    from keras_cutbce.item_table import ItemTable
    from keras_cutbce.registry import dispatch

    hidden, table, bias, log_q = _inputs(seed=4)
    h = ops.convert_to_tensor(hidden.reshape(-1, D))
    ids = ops.convert_to_tensor(np.where((IDS >= 0) & (IDS < V), IDS, -1).reshape(6, 3).astype("int32"))
    negs = ops.convert_to_tensor(np.where(NEGATIVES < V, NEGATIVES, -1).astype("int32"))
    out = [to_numpy(dispatch("cut_sampled_softmax", route, h, ItemTable.read(table), ids,
                             ops.convert_to_tensor(bias), negs, log_q=ops.convert_to_tensor(log_q),
                             negative_log_q=None, remove_accidental_hits=True, temperature=1.0,
                             chunk_size=None)) for route in ("gather", "reference")]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs_are_as_exact_as_the_dense_low_precision_loss(dtype):
    """bfloat16 / float16 hidden, table and bias: against the same loss on low-precision dense logits."""
    hidden, table, bias, log_q = _inputs(seed=5)
    low_inputs = [ops.cast(x, dtype) for x in (hidden, table, bias)]
    weights = ops.convert_to_tensor(np.linspace(0.5, 1.5, 6).astype("float32"))
    ids = ops.convert_to_tensor(np.where((IDS >= 0) & (IDS < V), IDS, -1).reshape(6, 3))
    negs = ops.convert_to_tensor(np.where(NEGATIVES < V, NEGATIVES, -1).astype("int32"))

    def ours(h, e, b):
        per = cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES, b, log_q=log_q)
        return ops.sum(weights * ops.reshape(per, (-1,)))

    def dense(h, e, b):  # the logits in the low dtype, as a dense Keras model computes them
        z = ops.cast(ops.matmul(ops.reshape(h, (6, D)), ops.transpose(e)) + b, "float32")
        safe, keep = distinct_targets(ids, V)
        lq = ops.convert_to_tensor(log_q)
        z_n = ops.take(z, ops.where(negs < 0, 0, negs), axis=1)
        z_t, z_n = candidate_logits(ops.take_along_axis(z, safe, axis=1), z_n, safe, keep, negs,
                                    log_q=lq, negative_log_q=ops.take(lq, ops.where(negs < 0, 0, negs)))
        return ops.sum(weights * sampled_softmax_loss(z_t, z_n, keep))

    value, grads = value_and_grads(ours, *low_inputs)
    low_value, low_grads = value_and_grads(dense, *low_inputs)
    loss64, grads64 = _oracle(*(to_numpy(x) for x in low_inputs), IDS, NEGATIVES, log_q=log_q,
                              weights=to_numpy(weights))
    assert_within_low_precision(value, low_value, np.sum(to_numpy(weights) * loss64), "loss")
    for name, got, low, want in zip(("hidden", "table", "bias"), grads, low_grads, grads64):
        assert_within_low_precision(got, low, want, f"d{name}")


def test_family_slopes_are_the_oracle_softmax():
    """The family's protocol slopes (`tile(grad=True)` + `positives`) are `softmax - y` over the candidates."""
    rng = np.random.default_rng(6)
    z = rng.normal(size=(4, 7)).astype("float32")
    keep = np.array([[True, False], [True, True], [False, False], [True, False]])
    family = SampledSoftmax()
    z_t = ops.where(keep, ops.convert_to_tensor(z[:, :2]), float("-inf"))
    z_n = ops.convert_to_tensor(z[:, 2:])
    acc = family.merge(family.merge(family.init(4), family.tile(z_t, None, loss=True, grad=False)[0]),
                       family.tile(z_n, None, loss=True, grad=False)[0])
    stats = family.statistics(acc)
    slope_t = to_numpy(family.tile(z_t, stats, loss=False, grad=True)[1])
    slope_t += to_numpy(family.positives(z_t, keep, loss=False, grad=True)[1])
    slope_n = to_numpy(family.tile(z_n, stats, loss=False, grad=True)[1])
    loss = to_numpy(sampled_softmax_loss(z_t, z_n, ops.convert_to_tensor(keep)))
    for m in range(4):
        cand = np.concatenate([z[m, :2][keep[m]], z[m, 2:]]).astype(np.float64)
        p = np.exp(cand - cand.max()) / np.exp(cand - cand.max()).sum()
        y = np.zeros_like(p)
        y[: keep[m].sum()] = 1.0 / max(keep[m].sum(), 1)
        if not keep[m].any():
            assert loss[m] == 0.0
            continue
        np.testing.assert_allclose(loss[m], np.log(np.exp(cand).sum()) - y @ cand, rtol=1e-5)
        np.testing.assert_allclose(np.concatenate([slope_t[m][keep[m]], slope_n[m]]), p - y,
                                   atol=1e-6)


@pytest.mark.parametrize("call,error", [
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES.reshape(3, 3)), ValueError),
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES + 0.5), ValueError),
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES > 3), TypeError),
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES, log_q=np.zeros(5, "float32")),
     ValueError),
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e, IDS, NEGATIVES, remove_accidental_hits=1),
     TypeError),
    (lambda h, e: cut_sampled_softmax_crossentropy(h, e[:, :4], IDS, NEGATIVES), ValueError),
    (lambda h, e: SampledSoftmaxLoss(e, 0), ValueError),
    (lambda h, e: SampledSoftmaxLoss(e, 4, sampler="zipf"), ValueError),
    (lambda h, e: SampledSoftmaxLoss(e, 4, temperature=0.0), ValueError),
    (lambda h, e: SampledSoftmaxLoss(e, 4, sampler=np.ones(5))(IDS, h), ValueError),
])
def test_bad_input_raises_a_clear_error(call, error):
    hidden, table, _, _ = _inputs()
    with pytest.raises(error, match="`"):
        call(hidden, table)


# -- the Keras loss -----------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["uniform", "log_uniform", "counts"])
def test_draws_are_reproducible_with_a_seed(sampler):
    counts = np.arange(V, dtype="float64") % 5
    sampler = counts if sampler == "counts" else sampler
    draws = [[to_numpy(SampledSoftmaxLoss(np.zeros((V, D), "float32"), 64, sampler=sampler,
                                          seed=seed).draw(V))] for seed in (1, 1, 2)]
    loss = SampledSoftmaxLoss(np.zeros((V, D), "float32"), 64, sampler=sampler, seed=1)
    first, second = to_numpy(loss.draw(V)), to_numpy(loss.draw(V))
    np.testing.assert_array_equal(draws[0][0], draws[1][0])
    np.testing.assert_array_equal(first, draws[0][0])
    assert not np.array_equal(first, second) and not np.array_equal(draws[0][0], draws[2][0])
    assert first.min() >= 0 and first.max() < V
    if isinstance(sampler, np.ndarray):
        assert np.all(counts[first] > 0)  # an item of count 0 is never drawn
    previous = keras.config.floatx()
    keras.config.set_floatx("float64")  # a float64 model (its reference step) draws the same ids
    try:
        again = to_numpy(SampledSoftmaxLoss(np.zeros((V, D), "float32"), 64, sampler=sampler, seed=1).draw(V))
    finally:
        keras.config.set_floatx(previous)
    np.testing.assert_array_equal(again, first)


def test_sampler_log_q_is_a_distribution():
    for sampler in ("uniform", "log_uniform", np.arange(V) + 1.0):
        log_q = to_numpy(samplers.make_sampler(sampler, V).log_q())
        np.testing.assert_allclose(np.exp(log_q).sum(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight", None])
def test_reductions_and_sample_weights(reduction):
    hidden, table, bias, _ = _inputs(seed=7)
    weights = np.array([[1.0, 0.0, 2.0], [0.5, 1.5, 1.0]], np.float32)
    options = dict(sampler="log_uniform", seed=3, bias=bias, reduction=reduction)
    got = to_numpy(SampledSoftmaxLoss(table, 9, **options)(IDS, hidden, sample_weight=weights))
    negatives = to_numpy(SampledSoftmaxLoss(table, 9, **options).draw(V))
    log_q = to_numpy(samplers.make_sampler("log_uniform", V).log_q())
    per, _ = _oracle(hidden, table, bias, IDS, negatives, log_q=log_q)
    weighted = weights.reshape(-1) * per
    want = {"sum": weighted.sum(), "sum_over_batch_size": weighted.sum() / 6,
            "mean_with_sample_weight": weighted.sum() / weights.sum(),
            None: weighted.reshape(2, 3)}[reduction]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("counts", [False, True])
def test_in_batch_and_mixed_negatives_with_their_corrections(counts):
    """In-batch alone: the batch's targets as negatives, `log` of each id's count (or `N q`);
    mixed with 5 uniform draws: each group its own `log(expected count)`, targets their sum."""
    hidden, table, bias, _ = _inputs(seed=8)
    item_counts = np.arange(V) + 1.0 if counts else None
    flat = np.where((IDS >= 0) & (IDS < V), IDS, -1).reshape(-1)
    valid = flat[flat >= 0]
    if counts:
        expected = len(valid) * item_counts / item_counts.sum()
    else:
        expected = np.bincount(valid, minlength=V).astype(np.float64)
    with np.errstate(divide="ignore"):
        log_b = np.log(expected)
    alone = to_numpy(SampledSoftmaxLoss(table, 0, in_batch_negatives=True, item_counts=item_counts,
                                        bias=bias, reduction=None)(IDS, hidden))
    want, _ = _oracle(hidden, table, bias, IDS, flat, log_q=log_b)
    np.testing.assert_allclose(alone.reshape(-1), want, rtol=1e-5, atol=1e-6)
    options = dict(in_batch_negatives=True, item_counts=item_counts, bias=bias, seed=5)
    mixed = to_numpy(SampledSoftmaxLoss(table, 5, reduction=None, **options)(IDS, hidden))
    drawn = to_numpy(SampledSoftmaxLoss(table, 5, **options).draw(V))
    log_s = np.log(5.0 / V)
    negative_log_q = [log_s] * 5 + [log_b[i] if i >= 0 else 0.0 for i in flat]
    want, _ = _oracle(hidden, table, bias, IDS, np.concatenate([drawn, flat]),
                      log_q=np.logaddexp(log_s, log_b), negative_log_q=negative_log_q)
    np.testing.assert_allclose(mixed.reshape(-1), want, rtol=1e-5, atol=1e-6)


def test_config_round_trip():
    counts = np.arange(V) + 1.0
    loss = SampledSoftmaxLoss(np.ones((V, D), "float32"), 7, sampler=counts, in_batch_negatives=True,
                              logq_correction=False, temperature=0.5, seed=11, reduction="sum",
                              name="ssm")
    config = loss.get_config()
    again = SampledSoftmaxLoss.from_config(config)
    assert again.get_config() == config
    assert isinstance(again.sampler, np.ndarray) and again.temperature == 0.5
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    np.testing.assert_array_equal(to_numpy(restored.draw(V)), to_numpy(loss.draw(V)))


@pytest.mark.parametrize("sampler", ["log_uniform", "in_batch"])
def test_fit_draws_inside_the_step_and_trains_the_table(sampler):
    """One SGD step of `fit` (compiled on JAX and TensorFlow): the step's negatives are the seed's
    first draw, and the table moves by `-lr` times the op's gradient with them."""
    rng = np.random.default_rng(4)
    items, model = _fit_model(4)
    x, y = rng.integers(0, V, size=(4, 3)), rng.integers(0, V, size=(4, 3, 2))
    options = dict(in_batch_negatives=True) if sampler == "in_batch" else dict(sampler=sampler)
    negatives = to_numpy(SampledSoftmaxLoss(items, 6, seed=9, **options).draw(V))
    log_q = samplers.make_sampler("log_uniform", V).log_q()
    weights = [to_numpy(v) for v in (items.embeddings, *model.get_layer("project").weights)]

    def expected(e, k, c):
        hidden = ops.matmul(ops.take(e, x, axis=0), k) + c
        if sampler == "in_batch":  # the sampled group (uniform: no shift) and the batch's counts
            counts = np.bincount(y.reshape(-1), minlength=V).astype("float32")
            log_b = np.log(np.maximum(counts, 1e-30))
            negs = np.concatenate([negatives, y.reshape(-1)])
            per = [_with_log_q(hidden, e, y, negs, np.logaddexp(np.log(6.0 / V), log_b),
                               np.concatenate([np.full(6, np.log(6.0 / V)), log_b[y.reshape(-1)]]))]
        else:
            per = [cut_sampled_softmax_crossentropy(hidden, e, y, negatives, log_q=log_q)]
        return ops.mean(per[0])

    want_loss, (grad_table, _, _) = value_and_grads(expected, *(np.float32(a) for a in weights))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=SampledSoftmaxLoss(items, 6, seed=9, **options))
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]
    np.testing.assert_allclose(history[0], want_loss, rtol=1e-5)
    np.testing.assert_allclose(to_numpy(items.embeddings), weights[0] - 0.5 * grad_table, atol=1e-6)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0)  # later steps: fresh draws, finite
    assert np.isfinite(model.evaluate(x, y, verbose=0))


def _fit_model(seed):
    """`(items, model)`: ids `[B, 3]` -> the item table -> a Dense layer, hidden `[B, 3, D]`."""
    keras.utils.set_random_seed(seed)
    items = keras.layers.Embedding(V, D, name="items")
    model = keras.Sequential([keras.Input((3,), dtype="int32"), items,
                              keras.layers.Dense(D, name="project")])
    return items, model


def _with_log_q(hidden, table, ids, negatives, log_q, negative_log_q):
    from keras_cutbce import checks
    from keras_cutbce.sampled import _sampled_loss

    inputs = checks.loss_inputs(hidden, table, ids)
    return _sampled_loss(inputs, ops.convert_to_tensor(negatives.astype("int32")),
                         ops.convert_to_tensor(log_q.astype("float32")),
                         ops.convert_to_tensor(negative_log_q.astype("float32")), True)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="reads the JAX program (jaxpr)")
def test_memory_is_positions_by_candidates_never_positions_by_vocab():
    """Loss and all three gradients: no value of the program is as large as `[positions, V]`."""
    import jax

    from tests.cutbce.kernel_inputs import largest_intermediate

    rows, vocab, dim, num_negatives = 64, 6000, 8, 32
    rng = np.random.default_rng(0)
    hidden, table = rng.normal(size=(rows, dim)).astype("float32"), rng.normal(size=(vocab, dim)).astype("float32")
    ids, negs = rng.integers(0, vocab, size=(rows, 2)), rng.integers(0, vocab, size=(num_negatives,))
    log_q = np.full((vocab,), -np.log(vocab), "float32")

    def total(h, e, b):
        return ops.sum(cut_sampled_softmax_crossentropy(h, e, ids, negs, b, log_q=log_q))

    largest = largest_intermediate(jax.grad(total, argnums=(0, 1, 2)), hidden, table, np.zeros(vocab, "float32"))
    assert largest <= vocab * dim, largest  # the table's own gradient; rows x V is 48x larger


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fit_under_mixed_precision_is_as_exact_as_the_dense_low_precision_model(policy):
    """A few `fit` steps under the policy: the logged loss within the low-precision error of float32's."""
    from tests.backend_utils import dtype_policy

    rng = np.random.default_rng(12)
    x, y = rng.integers(0, V, size=(8, 3)), rng.integers(-1, V, size=(8, 3, 2))
    losses = {}
    for name in ("float32", policy):
        with dtype_policy(name):
            items, model = _fit_model(1)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=SampledSoftmaxLoss(items, 8, sampler="log_uniform", seed=2))
            losses[name] = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(losses[policy], losses["float32"], rtol=2e-2)


def _users_losses(items, dense):
    """`users_model`'s losses: sampled softmax, popularity draws (logQ corrected) and the batch's targets;
    `dense`: the same loss on the dense logits `h @ E.T` (computed under the policy) through the
    identity table, so that only the logits' computation differs."""
    table = np.eye(items.input_dim, dtype="float32") if dense else items
    return SampledSoftmaxLoss(table, 16, sampler="log_uniform", in_batch_negatives=True, seed=4)


_USERS_FLOAT64 = []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_users_model_first_step_is_as_exact_as_the_dense_model(policy):
    """`test_loss.users_model` (a shared `ItemEmbedding` upstream of two `DetachBlock` towers with
    their own sampled loss, a reused block, batch norm, dropout, an L2 kernel regularizer), one SGD
    step against float64: the loss and the weights' changes no worse than twice the dense model's
    under the policy (`test_loss.assert_step_like_dense`). Every loss object draws the seed's
    negatives, so the dense twin and the float64 step see the same ones."""
    from tests.cutbce.test_loss import assert_step_like_dense, first_step, fit_data

    vocab, dim = 53, 8
    x, y = fit_data(vocab)
    cut = first_step(vocab, dim, x, y, policy, users=True, losses=_users_losses)
    dense = first_step(vocab, dim, x, y, policy, dense=True, users=True, losses=_users_losses)
    if not _USERS_FLOAT64:
        _USERS_FLOAT64.append(first_step(vocab, dim, x, y, "float64", users=True, losses=_users_losses))
    assert_step_like_dense(cut, dense, _USERS_FLOAT64[0], whole_model=policy != "float32")


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.distributed gloo ranks")
def test_users_model_on_two_data_parallel_ranks_steps_as_one_process():
    """`test_users_model_first_step_is_as_exact_as_the_dense_model`'s model and losses, one SGD step of
    `fit` on 2 gloo ranks (the table whole on each, every rank the same batch, so the same seeded
    draws and the ranks' mean gradient is one process's) under every policy: one process's step."""
    from keras_erase.torch.launch import run_local
    from tests.cutbce import vocab_parallel_ranks
    from tests.cutbce.test_loss import first_step, fit_data

    policies = ("float32", "mixed_bfloat16", "mixed_float16")
    per_rank = run_local(vocab_parallel_ranks.users_model_steps, 2,
                         args=(policies, _users_losses, False), threads_per_rank=1)
    x, y = fit_data(53)
    for index, policy in enumerate(policies):
        loss, changes = first_step(53, 8, x, y, policy, users=True, losses=_users_losses)
        for rank_loss, rank_changes in (result[index] for result in per_rank):
            np.testing.assert_allclose(rank_loss, loss, rtol=1e-6, err_msg=policy)
            for i, (got, want) in enumerate(zip(rank_changes, changes)):
                error = np.abs(got - want).max() / np.abs(want).max()
                assert error <= 1e-5, f"{policy} weight #{i}: {error:.2e} of its change"


def test_each_compiled_step_draws_the_seeds_next_negatives():
    """`train_on_batch` at learning rate 0 (compiled on JAX and TensorFlow): step k's loss is the op's
    with the seed's k-th draw, so the draws advance inside the compiled step."""
    rng = np.random.default_rng(5)
    items, model = _fit_model(2)
    x, y = rng.integers(0, V, size=(4, 3)), rng.integers(0, V, size=(4, 3, 2))
    model.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=SampledSoftmaxLoss(items, 5, sampler="log_uniform", seed=7))
    got = [float(np.ravel(model.train_on_batch(x, y))[0]) for _ in range(3)]
    hidden = model.predict(x, verbose=0)
    twin = SampledSoftmaxLoss(items, 5, sampler="log_uniform", seed=7)
    log_q = samplers.make_sampler("log_uniform", V).log_q()
    want = [float(ops.mean(cut_sampled_softmax_crossentropy(hidden, items, y, twin.draw(V), log_q=log_q)))
            for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(set(np.round(got, 6))) == 3


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="a custom jax.jit loop")
def test_custom_jax_loop_carries_the_seed_state_through_a_stateless_scope():
    import jax

    loss = SampledSoftmaxLoss(np.zeros((V, D), "float32"), 6, seed=3)

    @jax.jit
    def draw(state):
        with keras.StatelessScope(state_mapping=[(loss.seed_generator.state, state)]) as scope:
            ids = loss.draw(V)
        return ids, scope.get_current_value(loss.seed_generator.state)

    first, state = draw(loss.seed_generator.state.value)
    second, _ = draw(state)
    twin = SampledSoftmaxLoss(np.zeros((V, D), "float32"), 6, seed=3)
    np.testing.assert_array_equal(to_numpy(first), to_numpy(twin.draw(V)))
    np.testing.assert_array_equal(to_numpy(second), to_numpy(twin.draw(V)))
