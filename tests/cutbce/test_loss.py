"""`CutBCELoss` as a Keras loss: reductions, weights, masks, ids, serialization, fit."""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops

from keras_cutbce import CutBCELoss
from keras_cutbce.math.reference import multi_hot
from tests.backend_utils import BACKEND, to_numpy

REDUCTIONS = ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none", None]


def dense_logits_and_targets(hidden, table, ids):
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = (flat @ table.T).reshape(hidden.shape[:-1] + (table.shape[0],))
    targets = to_numpy(multi_hot(ids.reshape(-1, ids.shape[-1]), table.shape[0]))
    return logits.astype("float32"), targets.reshape(logits.shape).astype("float32")


def case(seed=0, batch=4, steps=5, dim=8, vocab=37, labels=3):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(batch, steps, dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32") * 0.5
    ids = rng.integers(-1, vocab, size=(batch, steps, labels)).astype("int32")
    return hidden, table, ids


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weights", [None, "per_position", "per_example"])
def test_reductions_and_sample_weights_match_keras(reduction, weights):
    hidden, table, ids = case()
    logits, targets = dense_logits_and_targets(hidden, table, ids)
    rng = np.random.default_rng(1)
    sw = None
    if weights == "per_position":
        sw = rng.uniform(0, 2, size=hidden.shape[:2]).astype("float32")
    elif weights == "per_example":
        sw = rng.uniform(0, 2, size=hidden.shape[:1]).astype("float32")
    ours = CutBCELoss(keras.Variable(table), reduction=reduction, chunk_size=16)(ids, hidden, sample_weight=sw)
    # A weight per example given as [B] is Keras's [B, 1] (Keras's own form for [B, T] losses).
    keras_sw = None if sw is None else sw.reshape(sw.shape + (1,) * (2 - sw.ndim))
    theirs = keras.losses.BinaryCrossentropy(from_logits=True, reduction=reduction)(
        targets, logits, sample_weight=keras_sw)
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), rtol=2e-5, atol=1e-6)


def test_keras_mask_on_hidden_is_applied():
    hidden, table, ids = case(seed=2)
    mask = np.array([[1, 1, 1, 0, 0]] * 4, bool)
    masked_hidden = ops.convert_to_tensor(hidden)
    from keras.src.backend.common.masking import set_keras_mask

    set_keras_mask(masked_hidden, ops.convert_to_tensor(mask))
    loss = CutBCELoss(keras.Variable(table))
    ours = to_numpy(loss(ids, masked_hidden))
    per_pos = to_numpy(CutBCELoss(keras.Variable(table), reduction="none")(ids, hidden))
    np.testing.assert_allclose(ours, per_pos[mask].mean(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("softmax", [False, True], ids=["bce", "softmax"])
def test_ids_stay_integers_beyond_float32_precision(softmax):
    from keras_cutbce import CutSoftmaxLoss

    vocab = 2**24 + 8
    dim = 2
    rng = np.random.default_rng(3)
    table = rng.normal(size=(vocab, dim)).astype("float32")
    hidden = rng.normal(size=(1, dim)).astype("float32")
    ids = np.array([[2**24 + 3]], "int64")  # float32(2**24 + 3) == 2**24 + 4
    unit = hidden[0] / np.dot(hidden[0], hidden[0])
    table[2**24 + 3] = 5000.0 * unit  # the true target scores +5000, its float32 twin -5000
    table[2**24 + 4] = -5000.0 * unit
    assert float(np.float32(ids[0, 0])) != ids[0, 0]
    z = hidden.astype(np.float64) @ table.T.astype(np.float64)
    if softmax:  # log-sum-exp minus the target's logit
        top = z.max()
        background, scale = top + np.log(np.exp(z - top).sum()), 1.0
    else:
        background, scale = np.logaddexp(0.0, z).sum(), 1.0 / vocab
    exact = (background - z[0, ids[0, 0]]) * scale
    rounded = (background - z[0, int(np.float32(ids[0, 0]))]) * scale
    assert abs(exact - rounded) > 1e-9  # the test can tell the two apart
    loss = (CutSoftmaxLoss if softmax else CutBCELoss)(keras.Variable(table), chunk_size=8192)
    value = to_numpy(loss(ops.convert_to_tensor(ids), hidden))
    assert abs(value - exact) < 0.01 * abs(exact - rounded), (value, exact, rounded)


def test_fractional_and_non_numeric_ids_are_rejected():
    hidden, table, ids = case()
    with pytest.raises(ValueError, match="`target_ids` must be whole-number"):
        CutBCELoss(keras.Variable(table))(ids.astype("float32") + 0.25, hidden)
    with pytest.raises(TypeError, match="`target_ids` must be integer"):
        CutBCELoss(keras.Variable(table))(ids >= 0, hidden)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(implementation="nope"), ["implementation", "'nope'"]),
        (dict(label_smoothing=-0.1), ["label_smoothing"]),
        (dict(pos_weight=-1.0), ["pos_weight"]),
        (dict(chunk_size=-4), ["chunk_size"]),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, words):
    with pytest.raises(ValueError) as info:
        CutBCELoss(keras.Variable(np.zeros((4, 2), "float32")), **kwargs)
    assert all(w in str(info.value) for w in words)


class DenseLogits(keras.layers.Layer):
    """hidden @ table.T with the table of a shared Embedding layer (the dense baseline)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, hidden):
        return ops.matmul(hidden, ops.transpose(self.embedding.embeddings))


def build_model(vocab, dim, dense=False, seed=0, users=False, losses=None, vocab_parallel=False):
    """An `Embedding`, a projection and the logits (`dense`) or the hidden states; with
    `users`, `users_model` (its blocks' local losses: the model's loss, `losses` or `local_loss`)."""
    keras.utils.set_random_seed(seed)
    if users:
        return users_model(vocab, dim, dense, losses or local_loss, vocab_parallel)
    inputs = keras.Input((None,), dtype="int32")
    items = keras.layers.Embedding(vocab, dim, name="items")
    hidden = keras.layers.Dense(dim, name="proj")(items(inputs))
    outputs = DenseLogits(items)(hidden) if dense else hidden
    return keras.Model(inputs, outputs), items


def users_model(vocab, dim, dense, losses, vocab_parallel=False):
    """The models users have: an `ItemEmbedding` shared by two towers (`DetachBlock`s whose
    local loss also trains it) and the main path; the layer `both` inside `tower_a` and outside
    any block; `tower_b` with an L2-regularized kernel and `BatchNormalization`; the block
    `reused` met twice; `Dropout` before the projection. The local loss: `losses(items, dense)`."""
    from keras_cutbce import ItemEmbedding
    from keras_erase import DetachBlock, EraseModel

    inputs = keras.Input((None,), dtype="int32")
    items = ItemEmbedding(vocab, dim, name="items", vocab_parallel=vocab_parallel)
    features = items(inputs)
    both = keras.layers.Dense(dim, activation="tanh", name="both")

    def block(name, layers, detach_input=False):
        head = [keras.layers.Dense(dim, name=f"{name}_head")] + [DenseLogits(items)] * dense
        return DetachBlock(keras.Sequential(layers, name=f"{name}_mlp"), head=keras.Sequential(head),
                           loss=losses(items, dense), loss_weight=0.5,
                           detach_input=detach_input, name=name)

    regularized = keras.layers.Dense(dim, activation="tanh", name="l2", use_bias=False,
                                     kernel_regularizer=keras.regularizers.L2(0.05))
    reused = block("reused", [keras.layers.Dense(dim, activation="tanh")], detach_input=True)
    sides = [keras.layers.Dense(dim, name=side)(features) for side in ("left", "right")]
    outs = [block("tower_a", [both, keras.layers.Dense(dim, activation="tanh")])(features),
            block("tower_b", [regularized, keras.layers.BatchNormalization()])(features),
            both(features)] + sides + [reused(side) for side in sides]
    hidden = keras.layers.Dropout(0.25, seed=3)(keras.layers.Concatenate()(outs))
    hidden = keras.layers.Dense(dim, name="proj")(hidden)
    outputs = DenseLogits(items)(hidden) if dense else hidden
    return EraseModel(inputs, outputs, dispatch="standard", intra_op_threads=None), items


def local_loss(items, dense):
    from keras_cutbce import CutSoftmaxLoss

    if dense:
        return keras.losses.CategoricalCrossentropy(from_logits=True)
    return CutSoftmaxLoss(items, chunk_size=16)


@contextlib.contextmanager
def _floatx(policy):
    """`floatx` float64 under the float64 policy: Keras casts the compiled loss to `floatx` and
    TensorFlow then refuses to add the float64 regularizer's loss to it."""
    previous = keras.config.floatx()
    keras.config.set_floatx("float64" if policy == "float64" else previous)
    try:
        yield
    finally:
        keras.config.set_floatx(previous)


def fit_data(vocab=53, batch=16, steps=6, labels=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(batch, steps)).astype("int32")
    y = (x[..., None] + np.arange(1, labels + 1)) % vocab  # learnable: next items
    y[:, -1, -1] = -1  # padding
    return x, y.astype("int32")


def first_step(vocab, dim, x, y, policy, dense=False, softmax=False, users=False, losses=None,
               vocab_parallel=False):
    """The loss and the weight change of one SGD(1) step of `build_model` under `policy`.

    BCE (`CutBCELoss` or Keras's dense loss), or with `softmax` the softmax
    cross-entropy (`CutSoftmaxLoss`, or Keras's on the targets `multi_hot / |P|`), or
    `losses(items, dense)` on the ids. `vocab_parallel`: the table split over this
    process group's ranks (its change gathered whole).
    """
    from keras_cutbce import CutSoftmaxLoss
    from tests.backend_utils import dtype_policy

    with dtype_policy("float32"):
        initial = build_model(vocab, dim, users=users, losses=losses)[0].get_weights()  # float64 draws others
    with dtype_policy(policy), _floatx(policy if users else None):
        model, items = build_model(vocab, dim, dense=dense, users=users, losses=losses,
                                   vocab_parallel=vocab_parallel)
        model.set_weights(_rows_held(model, initial, items))
        if losses is not None:
            loss = losses(items, dense)
        elif dense:
            hot = to_numpy(multi_hot(y.reshape(-1, y.shape[-1]), vocab)).reshape(x.shape + (vocab,))
            if softmax:
                hot = hot / np.maximum(hot.sum(-1, keepdims=True), 1.0)
                loss = local_loss(items, dense=True) if users else keras.losses.CategoricalCrossentropy(
                    from_logits=True)
            else:
                loss = keras.losses.BinaryCrossentropy(from_logits=True)
            y = hot
        elif users:
            loss = local_loss(items, dense=False)
        else:
            loss = (CutSoftmaxLoss if softmax else CutBCELoss)(items, chunk_size=16)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
        if policy == "mixed_float16":  # Keras scales the loss: the step goes through the scale
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        value = model.train_on_batch(x, np.asarray(y, "float32") if dense and losses is None else y)
        return value, [_whole(w, items) - w0 for w, w0 in zip(model.weights, initial)]


def assert_step_like_dense(cut, dense, true, whole_model=False):
    """`first_step`'s `(loss, changes)` of `cut` against float64's `true`: no worse than twice `dense`'s.

    The loss and each weight's change by `assert_within_low_precision`; `whole_model` (a mixed
    policy on `users_model`, whose many small biases move by less than their rounding): ERASE's
    bound, the worst weight's error relative to its float64 move at most twice the dense worst.
    """
    from tests.backend_utils import assert_within_low_precision

    (l_cut, cut), (l_dense, dense), (l_true, true) = cut, dense, true
    assert_within_low_precision(l_cut, l_dense, l_true, "loss")
    assert all(np.abs(a).max() > 0 for a in cut)  # every weight trained
    if whole_model:
        def worst(changes):
            return max(np.abs(a - t).max() / np.abs(t).max() for a, t in zip(changes, true))

        assert worst(cut) <= 2.0 * worst(dense), (worst(cut), worst(dense))
        return
    for i, (a, b, t) in enumerate(zip(cut, dense, true)):
        assert_within_low_precision(a, b, t, f"weight #{i} change")


def _rows_held(model, weights, items):
    """`model`'s `weights` with the item table's rows cut to the ones this rank holds."""
    layout = getattr(items, "vocab_layout", None)
    if layout is None:
        return weights
    return [w[layout.start:layout.stop] if v.path == items.embeddings.path else w
            for v, w in zip(model.weights, weights)]


def _whole(weight, items):
    """A weight's value; the split item table gathered whole."""
    layout = getattr(items, "vocab_layout", None)
    if layout is None or weight.path != items.embeddings.path:
        return to_numpy(weight)
    from keras_cutbce.backends.torch import vocab_parallel

    return vocab_parallel.gather_table(weight.value, layout)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_first_step_under_every_policy_matches_dense_bce_and_loss_falls(policy):
    """One step of `fit` under each policy against float64: the loss and every weight's change
    (each table row: an item) no worse than twice the dense Keras model's under the policy."""
    from tests.backend_utils import assert_within_low_precision

    vocab, dim = 53, 8
    x, y = fit_data(vocab)
    l_cut, cut = first_step(vocab, dim, x, y, policy)
    l_dense, dense = first_step(vocab, dim, x, y, policy, dense=True)
    l_true, true = first_step(vocab, dim, x, y, "float64")
    assert_within_low_precision(l_cut, l_dense, l_true, "loss")
    for i, (a, b, t) in enumerate(zip(cut, dense, true)):
        assert np.abs(a).max() > 0  # the table (and the projection) trained
        assert_within_low_precision(a, b, t, f"weight #{i} change")
    if policy != "float32":
        return
    model, items = build_model(vocab, dim, seed=1)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=CutBCELoss(items))
    history = model.fit(x, y, epochs=8, batch_size=8, verbose=0).history["loss"]
    assert history[-1] < 0.7 * history[0]


@pytest.mark.slow
@pytest.mark.parametrize("loss_class", ["CutBCELoss", "CutSoftmaxLoss"])
def test_save_and_load_rebinds_the_table(tmp_path, loss_class):
    import keras_cutbce

    vocab, dim = 31, 4
    x, y = fit_data(vocab)
    model, items = build_model(vocab, dim)
    loss_class = getattr(keras_cutbce, loss_class)
    model.compile(optimizer="adam", loss=loss_class(items, label_smoothing=0.1, chunk_size=8))
    model.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    loss = loaded.loss
    assert type(loss) is loss_class
    assert loss.embeddings is loaded.get_layer("items").embeddings
    assert loss.label_smoothing == 0.1 and loss.chunk_size == 8
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-5)
    before = to_numpy(loaded.get_layer("items").embeddings)
    loaded.fit(x, y, epochs=1, verbose=0)
    assert np.abs(to_numpy(loaded.get_layer("items").embeddings) - before).max() > 0


def test_config_round_trip_without_a_model_fails_clearly():
    table = keras.Variable(np.zeros((5, 2), "float32"), name="lonely")
    config = CutBCELoss(table, pos_weight=2.0).get_config()
    assert config["embeddings"] == table.path
    restored = CutBCELoss.from_config(config)
    assert restored.pos_weight == 2.0
    with pytest.raises(ValueError, match="no Keras model"):
        restored(np.zeros((1, 1), "int32"), np.zeros((1, 2), "float32"))


def test_reversible_embedding_table():
    layer = keras.layers.ReversibleEmbedding(11, 4)
    layer.build((None,))
    hidden = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    ids = np.array([[1], [2], [10]], "int32")
    a = to_numpy(CutBCELoss(layer)(ids, hidden))
    b = to_numpy(CutBCELoss(keras.Variable(to_numpy(layer.embeddings)))(ids, hidden))
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight", "none"])
@pytest.mark.parametrize("implementation", ["chunked", "reference"])
@pytest.mark.slow
def test_reduced_loss_gradients_match_keras_with_weights_and_mask(reduction, implementation):
    """The fused reduced path (weighted sum) and the per-position path give Keras's gradients."""
    from keras.src.backend.common.masking import set_keras_mask

    from tests.backend_utils import value_and_grads

    hidden, table, ids = case(seed=4, vocab=301)
    rng = np.random.default_rng(5)
    sw = rng.uniform(0, 2, size=hidden.shape[:1]).astype("float32")
    mask = ops.convert_to_tensor(rng.uniform(size=hidden.shape[:2]) > 0.3)
    _, targets = dense_logits_and_targets(hidden, table, ids)
    keras_sw = np.broadcast_to(sw[:, None], hidden.shape[:2])

    def ours(h, t):
        set_keras_mask(h, mask)
        loss = CutBCELoss(t, reduction=reduction, chunk_size=64, implementation=implementation)
        return ops.sum(loss(ids, h, sample_weight=sw) * 1.7)

    def theirs(h, t):
        logits = ops.matmul(h, ops.transpose(t))
        set_keras_mask(logits, mask)
        loss = keras.losses.BinaryCrossentropy(from_logits=True, reduction=reduction)
        return ops.sum(loss(targets, logits, sample_weight=keras_sw) * 1.7)

    value, grads = value_and_grads(ours, hidden, table)
    value_k, grads_k = value_and_grads(theirs, hidden, table)
    np.testing.assert_allclose(value, value_k, rtol=2e-5)
    for g, gk in zip(grads, grads_k):
        np.testing.assert_allclose(g, gk, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_lora_embedding_table_trains_saves_and_loads(tmp_path):
    """A LoRA-enabled Embedding as the table: the loss reads the merged table, saves, reloads."""
    vocab, dim = 31, 4
    x, y = fit_data(vocab)
    model, items = build_model(vocab, dim)
    items.enable_lora(2)
    loss = CutBCELoss(items, chunk_size=8)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    lora_b = to_numpy(items.lora_embeddings_b)
    model.fit(x, y, epochs=2, verbose=0)
    assert np.abs(to_numpy(items.lora_embeddings_b) - lora_b).max() > 0  # LoRA trains through the loss
    hidden = to_numpy(model.predict(x, verbose=0))
    merged = to_numpy(items.embeddings)
    np.testing.assert_allclose(
        to_numpy(loss(y, hidden)),
        to_numpy(CutBCELoss(keras.Variable(merged), chunk_size=8)(y, hidden)),
        rtol=1e-5,
    )
    assert loss.get_config()["embeddings"] == items.weights[0].path
    path = tmp_path / "lora.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.loss, CutBCELoss)
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-5
    )
