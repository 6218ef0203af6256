"""`ItemEmbedding`: an item table layer owning a trainable bias, read by the loss, ops and metrics.

Checked against the dense reference: Keras's `binary_crossentropy` on
`h @ E.T + b`, values and first-step updates of every weight (the bias
included), through `fit` on the active backend (on JAX, Keras's stateless
train step), and saved / loaded in a `.keras` file.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_cutbce import CutBCELoss, ItemEmbedding, ThresholdConfusion, TopKRetrieval
from keras_cutbce import cut_binary_crossentropy, cut_top_k
from keras_cutbce.math.reference import multi_hot
from tests.backend_utils import BACKEND, to_numpy

VOCAB, DIM, STEPS = 29, 4, 5


class DenseLogits(keras.layers.Layer):
    """`hidden @ E.T + b` with the table and bias of an `ItemEmbedding` (the dense baseline)."""

    def __init__(self, items, **kwargs):
        super().__init__(**kwargs)
        self.items = items

    def call(self, hidden):
        return ops.matmul(hidden, ops.transpose(self.items.embeddings)) + self.items.bias


def build(dense=False, seed=0):
    keras.utils.set_random_seed(seed)
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, bias_initializer="random_normal",
                          name="items")
    ids = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Dense(DIM, name="proj")(items(ids))
    outputs = DenseLogits(items)(hidden) if dense else hidden
    return keras.Model(ids, outputs), items


def data(seed=0, batch=6):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(batch, STEPS)).astype("int32")
    y = rng.integers(-1, VOCAB, size=(batch, STEPS, 3)).astype("int32")
    y[0, 0] = -1  # a position without targets
    return x, y


def dense_targets(y):
    return to_numpy(multi_hot(y.reshape(-1, y.shape[-1]), VOCAB)).reshape(
        y.shape[:-1] + (VOCAB,)
    ).astype("float32")


def dense_bce(hidden, table, bias, y):
    logits = np.einsum("btd,vd->btv", hidden, table) + bias
    return float(to_numpy(keras.losses.BinaryCrossentropy(from_logits=True)(
        dense_targets(y), logits.astype("float32"))))


# -- the layer ---------------------------------------------------------------------------


def test_layer_owns_table_and_bias_and_embeds_ids():
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, name="items")
    out = items(np.array([[0, 3]], "int32"))
    assert tuple(out.shape) == (1, 2, DIM)
    np.testing.assert_array_equal(to_numpy(out)[0, 1], to_numpy(items.embeddings)[3])
    assert [w.path for w in items.trainable_weights] == ["items/embeddings", "items/bias"]
    assert tuple(items.bias.shape) == (VOCAB,)
    np.testing.assert_array_equal(to_numpy(items.bias), np.zeros(VOCAB))
    plain = ItemEmbedding(VOCAB, DIM)
    plain.build()
    assert plain.bias is None and len(plain.weights) == 1
    with pytest.raises(TypeError, match="use_bias"):
        ItemEmbedding(VOCAB, DIM, use_bias="yes")


def test_layer_config_round_trip():
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, bias_initializer="ones",
                          bias_regularizer="l2", mask_zero=True, name="items")
    config = keras.saving.serialize_keras_object(items)
    assert config["registered_name"] == "keras_cutbce>ItemEmbedding"
    clone = keras.saving.deserialize_keras_object(config)
    assert isinstance(clone, ItemEmbedding)
    assert clone.use_bias and clone.mask_zero and clone.input_dim == VOCAB
    clone.build()
    np.testing.assert_array_equal(to_numpy(clone.bias), np.ones(VOCAB))
    assert clone.bias_regularizer is not None


def test_lora_layer_keeps_a_trainable_bias():
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, lora_rank=2)
    items.build()
    assert items.lora_enabled
    trainable = {w.name for w in items.trainable_weights}
    assert trainable == {"bias", "lora_embeddings_a", "lora_embeddings_b"}


# -- the ops and metrics read the bias -----------------------------------------------------


def test_ops_and_metrics_read_the_layers_bias():
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, bias_initializer="random_normal")
    items.build()
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(3, STEPS, DIM)).astype("float32")
    _, y = data(batch=3)
    table, bias = to_numpy(items.embeddings), to_numpy(items.bias)
    assert np.abs(bias).max() > 0.01
    want = dense_bce(hidden, table, bias, y)
    assert float(to_numpy(CutBCELoss(items, chunk_size=8)(y, hidden))) == pytest.approx(
        want, rel=1e-5)
    per_position = to_numpy(cut_binary_crossentropy(hidden, items, y, chunk_size=8))
    assert per_position.mean() == pytest.approx(want, rel=1e-5)
    without = to_numpy(cut_binary_crossentropy(hidden, table, y))
    assert np.abs(per_position - without).max() > 1e-4  # the bias does change the loss
    scores, ids = cut_top_k(hidden, items, k=4, chunk_size=8)
    logits = np.einsum("btd,vd->btv", hidden, table) + bias
    np.testing.assert_array_equal(to_numpy(ids), np.argsort(-logits, axis=-1)[..., :4])
    np.testing.assert_allclose(to_numpy(scores), -np.sort(-logits, axis=-1)[..., :4],
                               rtol=1e-5, atol=1e-5)
    for metric_type in (TopKRetrieval, ThresholdConfusion):
        own, explicit = metric_type(items), metric_type(table, bias=bias)
        own.update_state(y, hidden)
        explicit.update_state(y, hidden)
        got = {k: float(to_numpy(v)) for k, v in own.result().items()}
        assert got == pytest.approx({k: float(to_numpy(v)) for k, v in explicit.result().items()})


def test_a_second_bias_with_the_layers_is_refused():
    items = ItemEmbedding(VOCAB, DIM, use_bias=True, name="items")
    items.build()
    hidden = np.zeros((2, DIM), "float32")
    other = np.zeros(VOCAB, "float32")
    with pytest.raises(ValueError, match=r"'items' owns a bias.*pass one of them.*Received: bias="):
        cut_binary_crossentropy(hidden, items, np.array([[1], [2]]), bias=other)
    with pytest.raises(ValueError, match="owns a bias"):
        CutBCELoss(items, bias=other)(np.array([[1], [2]]), hidden)
    # The layer's own bias, given again, is the same bias.
    a = cut_binary_crossentropy(hidden, items, np.array([[1], [2]]), bias=items.bias)
    b = cut_binary_crossentropy(hidden, items, np.array([[1], [2]]))
    np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


# -- fit -------------------------------------------------------------------------------


@pytest.mark.slow
def test_fit_first_step_matches_dense_bce_for_table_bias_and_model():
    x, y = data()
    cut_model, items = build()
    dense_model, _ = build(dense=True)
    dense_model.set_weights(cut_model.get_weights())
    cut_model.compile(optimizer=keras.optimizers.SGD(1.0), loss=CutBCELoss(items, chunk_size=8))
    dense_model.compile(optimizer=keras.optimizers.SGD(1.0),
                        loss=keras.losses.BinaryCrossentropy(from_logits=True))
    start = [to_numpy(w).copy() for w in cut_model.trainable_weights]
    assert [w.path for w in cut_model.trainable_weights][:2] == ["items/embeddings", "items/bias"]
    history = cut_model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    dense_history = dense_model.fit(x, dense_targets(y), batch_size=len(x), epochs=1,
                                    verbose=0, shuffle=False)
    assert history.history["loss"][0] == pytest.approx(dense_history.history["loss"][0], rel=1e-5)
    for path, w0, a, b in zip(
        [w.path for w in cut_model.trainable_weights], start,
        cut_model.trainable_weights, dense_model.trainable_weights,
    ):
        step, dense_step = to_numpy(a) - w0, to_numpy(b) - w0
        assert np.abs(step).max() > 1e-6, path  # every weight trained, the bias included
        np.testing.assert_allclose(step, dense_step, rtol=1e-4, atol=1e-7, err_msg=path)


@pytest.mark.slow
def test_bias_trains_with_metrics_in_the_step():
    """Metrics compiled with the loss read the same (traced, on JAX) table and bias."""
    x, y = data()
    model, items = build()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=CutBCELoss(items, chunk_size=8),
                  metrics=[TopKRetrieval(items, k=(1, 3))])
    before = to_numpy(items.bias).copy()
    model.fit(x, y, epochs=2, verbose=0)
    assert np.abs(to_numpy(items.bias) - before).max() > 1e-3
    logs = model.evaluate(x, y, verbose=0, return_dict=True, batch_size=len(x))
    alone = TopKRetrieval(to_numpy(items.embeddings), k=(1, 3), bias=to_numpy(items.bias))
    alone.update_state(y, model.predict(x, verbose=0))
    assert logs["ndcg@3"] == pytest.approx(float(to_numpy(alone.result()["ndcg@3"])), rel=1e-5)


@pytest.mark.slow
def test_save_and_load_round_trip(tmp_path):
    x, y = data()
    model, items = build()
    model.compile(optimizer="adam", loss=CutBCELoss(items, chunk_size=8),
                  metrics=[TopKRetrieval(items, k=2)])
    model.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "bias.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    layer = loaded.get_layer("items")
    assert isinstance(layer, ItemEmbedding) and layer.use_bias
    np.testing.assert_array_equal(to_numpy(layer.bias), to_numpy(items.bias))
    assert loaded.loss.embeddings is layer.embeddings and loaded.loss.bias is layer.bias
    hidden = to_numpy(loaded.predict(x, verbose=0))
    want = dense_bce(hidden, to_numpy(layer.embeddings), to_numpy(layer.bias), y)
    assert float(to_numpy(loaded.loss(y, hidden))) == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-5)
    before = to_numpy(layer.bias).copy()
    loaded.fit(x, y, epochs=1, verbose=0)
    assert np.abs(to_numpy(layer.bias) - before).max() > 0


# -- a bias outside the model -----------------------------------------------------------


def test_free_bias_variable_fails_naming_the_bias():
    x, y = data()
    model, _ = build()
    items = model.get_layer("items")
    free = keras.Variable(np.zeros(VOCAB, "float32"), name="item_bias")
    model.compile(optimizer="sgd",
                  loss=CutBCELoss(items.embeddings, bias=free, chunk_size=8))
    with pytest.raises(ValueError) as info:
        model.fit(x, y, epochs=1, verbose=0)
    message = str(info.value)
    assert "CutBCELoss's bias is not among the trainable variables" in message
    assert "item_bias" in message and "ItemEmbedding(num_items, dim, use_bias=True)" in message
    assert "item table is not" not in message and "get_layer('items')" not in message
    np.testing.assert_array_equal(to_numpy(free), np.zeros(VOCAB))


def test_frozen_free_bias_is_used_as_it_is():
    x, y = data()
    model, items = build()
    fixed = keras.Variable(np.full(VOCAB, -1.0, "float32"), trainable=False)
    model.compile(optimizer="sgd", loss=CutBCELoss(items.embeddings, bias=fixed, chunk_size=8))
    assert np.isfinite(model.fit(x, y, epochs=1, verbose=0).history["loss"][0])
    hidden = to_numpy(model.predict(x, verbose=0))
    want = dense_bce(hidden, to_numpy(items.embeddings), np.full(VOCAB, -1.0), y)
    assert float(to_numpy(model.loss(y, hidden))) == pytest.approx(want, rel=1e-5)


# -- JAX custom loop --------------------------------------------------------------------


@pytest.mark.skipif(BACKEND != "jax", reason="JAX stateless training loop")
@pytest.mark.slow
def test_jax_stateless_compute_loss_differentiates_the_bias():
    import jax

    x, y = data()
    model, items = build()
    model.compile(optimizer="sgd", loss=CutBCELoss(items, chunk_size=8))
    model.fit(x, y, epochs=1, verbose=0)
    paths = [v.path for v in model.trainable_variables]
    table_at, bias_at = paths.index("items/embeddings"), paths.index("items/bias")

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        metrics = [v.value for v in model.metrics_variables]
        value, _ = model.stateless_compute_loss(
            trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred)
        return value

    def dense(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        logits = jax.numpy.einsum("btd,vd->btv", y_pred, trainable[table_at]) + trainable[bias_at]
        return keras.losses.BinaryCrossentropy(from_logits=True)(dense_targets(y), logits)

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    got = jax.jit(jax.grad(objective))(trainable, non_trainable, x, y)
    want = jax.grad(dense)(trainable, non_trainable, x, y)
    assert np.abs(to_numpy(want[bias_at])).max() > 1e-4
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_numpy(g), to_numpy(w), rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_lora_layer_with_a_bias_saves_and_loads(tmp_path):
    """The bias of a LoRA-enabled ItemEmbedding re-binds as the bias (the table as the merged layer)."""
    x, y = data()
    model, items = build()
    items.enable_lora(2)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=CutBCELoss(items, chunk_size=8))
    before = to_numpy(items.bias).copy()
    model.fit(x, y, epochs=1, verbose=0)
    assert np.abs(to_numpy(items.bias) - before).max() > 0
    path = tmp_path / "lora_bias.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    layer = loaded.get_layer("items")
    assert loaded.loss.bias is layer.bias
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-5)
