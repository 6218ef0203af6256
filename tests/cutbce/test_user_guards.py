"""No silent no-ops for a Keras user, on every backend.

1. A trainable item table that is not one of the model's variables: the first
   train step raises a `ValueError` saying so, on every backend. A frozen or
   constant table outside the model trains the model as asked.
2. A constant (NumPy) table is saved in the loss's config: `model.save` and
   `keras.saving.load_model` work, and the reloaded loss gives the same value.
3. Two retrieval metrics of one (default) name in one model log apart, as
   Keras's own metrics do (`auc`, `auc_1`): `hit@1` and `top_k_retrieval_1_hit@1`.
4. `count_out_of_range_ids` lists the ids the loss treats as padding, with counts.
5. Multi-hot labels `[..., V]` (the dense-BCE habit) are refused by the op, by
   `CutBCELoss` inside `fit` and by every metric, naming `multi_hot_to_ids`.
6. `exclude_ids` name their own axis: `[..., X]`; a `[B, T]` array (e.g. the
   input sequences) is refused with the two forms it may have meant.
7. A `ReversibleEmbedding` scores with what `reverse=True` computes (its own
   `reverse_embeddings` when untied); a logit soft cap is refused.
8. A wrong target shape is reported as it was passed.
"""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, CutSoftmaxLoss, MeanReciprocalRank, OutOfRangeTargets, ThresholdConfusion
from keras_cutbce import TopKRetrieval, count_out_of_range_ids, cut_binary_crossentropy, cut_top_k
from keras_cutbce import multi_hot_to_ids, seen_items
from keras_cutbce.math import reference
from tests.backend_utils import to_numpy
from tests.cutbce.test_training_loops import DIM, VOCAB, data, frozen_table
from tests.cutbce.test_training_loops import tied_model as model_and_items

ROWS = 6  # data(): x [6, 3], y [6, 3, 2]


def weights_of(model):
    return [to_numpy(v).copy() for v in model.trainable_variables]


# -- 1. a table outside the model --------------------------------------------------


def test_trainable_table_outside_the_model_fails_at_the_first_train_step():
    other = keras.layers.Embedding(VOCAB, DIM, name="other_items")
    other.build((None,))
    before = to_numpy(other.embeddings).copy()
    model, _ = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(other, chunk_size=8))
    x, y = data()
    with pytest.raises(ValueError, match=r"not among the trainable variables.*other_items"):
        model.fit(x, y, epochs=1, verbose=0)
    np.testing.assert_array_equal(to_numpy(other.embeddings), before)


def test_trainable_variable_outside_the_model_fails_too():
    table = keras.Variable(np.ones((VOCAB, DIM), "float32"), name="loose_table")
    model, _ = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(table, chunk_size=8))
    x, y = data()
    with pytest.raises(ValueError, match="loose_table.*would never be updated by `fit`"):
        model.fit(x, y, epochs=1, verbose=0)


def test_a_table_outside_the_model_still_evaluates():
    """Only training is refused: `evaluate` (no gradient) reads the table as it is."""
    other = keras.layers.Embedding(VOCAB, DIM)
    other.build((None,))
    model, _ = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(other, chunk_size=8))
    x, y = data()
    got = model.evaluate(x, y, verbose=0, batch_size=ROWS)
    hidden = to_numpy(model.predict(x, verbose=0))
    table = to_numpy(other.embeddings)
    targets = to_numpy(reference.multi_hot(y.reshape(-1, 2), VOCAB)).reshape(ROWS, 3, VOCAB)
    dense = keras.losses.BinaryCrossentropy(from_logits=True)(targets, hidden @ table.T)
    assert got == pytest.approx(float(to_numpy(dense)), rel=1e-5)


@pytest.mark.parametrize("frozen", ["layer", "variable", "numpy"])
def test_frozen_table_outside_the_model_trains_the_model(frozen):
    values = np.random.default_rng(1).normal(size=(VOCAB, DIM)).astype("float32")
    table = values if frozen == "numpy" else frozen_table(frozen, values)
    model, _ = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(table, chunk_size=8))
    x, y = data()
    start = weights_of(model)
    history = model.fit(x, y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any(np.abs(a - b).max() > 0 for a, b in zip(start, weights_of(model)))
    if frozen != "numpy":
        source = table.embeddings if frozen == "layer" else table
        np.testing.assert_array_equal(to_numpy(source), values)


def test_the_models_own_table_trains():
    model, items = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(items, chunk_size=8))
    before = to_numpy(items.embeddings).copy()
    x, y = data()
    model.fit(x, y, epochs=1, verbose=0)
    assert np.abs(to_numpy(items.embeddings) - before).max() > 0


# -- 2. a constant table saves --------------------------------------------------------


def test_numpy_table_saves_and_loads_as_a_constant(tmp_path):
    table = np.random.default_rng(2).normal(size=(VOCAB, DIM)).astype("float32")
    model, _ = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(table, chunk_size=8))
    x, y = data()
    model.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "constant_table.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    restored = loaded.loss.embeddings
    np.testing.assert_array_equal(np.asarray(restored), table)
    hidden = to_numpy(model.predict(x, verbose=0))
    targets = to_numpy(reference.multi_hot(y.reshape(-1, 2), VOCAB)).reshape(ROWS, 3, VOCAB)
    dense = keras.losses.BinaryCrossentropy(from_logits=True)(targets, hidden @ table.T)
    got = float(to_numpy(loaded.loss(y, hidden)))
    assert got == pytest.approx(float(to_numpy(dense)), rel=1e-5)


def test_constant_table_config_round_trip():
    table = np.arange(VOCAB * DIM, dtype="float32").reshape(VOCAB, DIM) / 7.0
    bias = np.linspace(-1, 1, VOCAB).astype("float32")
    config = CutBCELoss(keras.ops.convert_to_tensor(table), bias, pos_weight=2.0).get_config()
    clone = CutBCELoss.from_config(config)
    np.testing.assert_array_equal(np.asarray(clone.embeddings), table)
    np.testing.assert_array_equal(np.asarray(clone.bias), bias)
    assert clone.pos_weight == 2.0
    metric = TopKRetrieval(table, k=2)
    np.testing.assert_array_equal(
        np.asarray(TopKRetrieval.from_config(metric.get_config()).embeddings), table
    )


# -- 3. unique metric names --------------------------------------------------------------


def test_two_default_named_metrics_log_apart(tmp_path):
    model, items = model_and_items()
    first, second = TopKRetrieval(items, k=1), TopKRetrieval(items, k=(1, 2))
    third, fourth = ThresholdConfusion(items), ThresholdConfusion(items, threshold=0.3)
    model.compile(
        optimizer="sgd",
        loss=CutBCELoss(items, chunk_size=8),
        metrics=[first, second, third, fourth],
    )
    x, y = data()
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    retrieval = {"hit@1", "recall@1", "ndcg@1", "precision@1"}
    expected = {"loss"} | retrieval | {f"top_k_retrieval_1_{k}" for k in retrieval}
    expected |= {f"top_k_retrieval_1_{m}@2" for m in ("hit", "recall", "ndcg", "precision")}
    expected |= {"precision", "recall", "f1"}
    expected |= {f"threshold_confusion_1_{m}" for m in ("precision", "recall", "f1")}
    assert set(logs) == expected
    # Each key holds its own metric's value, equal to a standalone metric's.
    hidden = model.predict(x, verbose=0)
    alone = TopKRetrieval(items, k=(1, 2))
    alone.update_state(y, hidden)
    assert {k: float(to_numpy(v)) for k, v in alone.result().items()} == pytest.approx(
        {k.removeprefix("top_k_retrieval_1_"): logs[k] for k in logs if "top_k_retrieval_1" in k}
    )
    low = ThresholdConfusion(items, threshold=0.3)
    low.update_state(y, hidden)
    assert float(to_numpy(low.result()["precision"])) == pytest.approx(
        logs["threshold_confusion_1_precision"]
    )
    # Outside a compiled model the keys stay plain, however many metrics exist.
    assert set(second.result()) == {
        f"{m}@{k}" for m in ("hit", "recall", "ndcg", "precision") for k in (1, 2)
    }
    history = model.fit(x, y, epochs=1, verbose=0)  # the train logs too
    assert set(history.history) == expected


# -- 4. ids outside [0, V) ----------------------------------------------------------------


def test_count_out_of_range_ids_finds_the_off_by_one():
    one_based = np.array([[1, 2, VOCAB], [VOCAB, -1, 3]], dtype="int64")
    items = keras.layers.Embedding(VOCAB, DIM)
    items.build((None,))
    assert count_out_of_range_ids(one_based, items) == {-1: 1, VOCAB: 2}
    assert count_out_of_range_ids(one_based, VOCAB) == {-1: 1, VOCAB: 2}
    assert count_out_of_range_ids(keras.ops.convert_to_tensor(one_based), items.embeddings) == {
        -1: 1,
        VOCAB: 2,
    }
    assert count_out_of_range_ids(one_based, VOCAB + 1) == {-1: 1}
    wide = np.array([2**32 + 1, 0], dtype="int64")  # would wrap to item 1 in int32
    assert count_out_of_range_ids(wide, VOCAB) == {2**32 + 1: 1}


def test_count_out_of_range_ids_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"`ids` must be whole-number item ids.*values \[1\.5\]"):
        count_out_of_range_ids(np.array([1.5, 2.0]), VOCAB)
    with pytest.raises(TypeError, match=r"`ids` must be integer item ids.*Received: ids\.dtype=bool"):
        count_out_of_range_ids(np.array([True]), VOCAB)
    with pytest.raises(ValueError, match="`embeddings` must be an int >= 1. Received: embeddings=0"):
        count_out_of_range_ids([1, 2], 0)


def test_metrics_of_a_multi_output_model_log_per_output():
    """As Keras logs `a_auc` and `b_auc`: `a_hit@1` and `b_hit@1`."""
    keras.utils.set_random_seed(0)
    items = keras.layers.Embedding(VOCAB, DIM, name="items")
    ids = keras.Input((3,), dtype="int32")
    embedded = items(ids)
    outputs = {
        "a": keras.layers.Dense(DIM, name="a")(embedded),
        "b": keras.layers.Dense(DIM, name="b")(embedded),
    }
    model = keras.Model(ids, outputs)
    model.compile(
        optimizer="sgd",
        loss={"a": CutBCELoss(items, chunk_size=8), "b": CutBCELoss(items, chunk_size=8)},
        metrics={"a": [TopKRetrieval(items, k=1)], "b": [TopKRetrieval(items, k=1)]},
    )
    x, y = data()
    logs = model.evaluate(x, {"a": y, "b": y}, verbose=0, return_dict=True, batch_size=ROWS)
    per_output = {f"{o}_{m}@1" for o in "ab" for m in ("hit", "recall", "ndcg", "precision")}
    assert per_output <= set(logs)
    hidden = model.predict(x, verbose=0)
    for output in "ab":
        alone = TopKRetrieval(items, k=1)
        alone.update_state(y, hidden[output])
        assert logs[f"{output}_ndcg@1"] == pytest.approx(float(to_numpy(alone.result()["ndcg@1"])))


# -- 5. multi-hot labels ---------------------------------------------------------------


def multi_hot(ids, vocab=VOCAB):
    """Int 0/1 labels `[..., V]` of the valid ids `[..., L]`."""
    labels = np.zeros(ids.shape[:-1] + (vocab,), "int32")
    for index in np.ndindex(ids.shape[:-1]):
        labels[index][[i for i in ids[index] if 0 <= i < vocab]] = 1
    return labels


def dense_bce(hidden, table, labels):
    logits = keras.ops.convert_to_tensor(hidden @ table.T)
    labels = keras.ops.convert_to_tensor(labels.astype("float32"))
    return to_numpy(keras.losses.binary_crossentropy(labels, logits, from_logits=True))


def test_multi_hot_labels_are_refused_everywhere_and_convert():
    model, items = model_and_items()
    x, y = data()
    labels = multi_hot(y)
    hidden = model.predict(x, verbose=0)
    table = to_numpy(items.embeddings).astype("float32")
    said = r"looks like multi-hot labels \[\.\.\., V\].*V = 23 entries and its values are all 0 or 1"
    with pytest.raises(ValueError, match=said + r".*multi_hot_to_ids.*target_ids\.shape=\(6, 3, 23\)"):
        cut_binary_crossentropy(hidden, table, labels)
    for metric in (TopKRetrieval(items, k=3), MeanReciprocalRank(items),
                   ThresholdConfusion(items), OutOfRangeTargets(items)):
        with pytest.raises(ValueError, match="`y_true` looks like multi-hot"):
            metric.update_state(labels, hidden)
    with pytest.raises(ValueError, match="`exclude_ids` looks like multi-hot"):
        cut_top_k(hidden, table, 3, exclude_ids=labels)
    with pytest.raises(ValueError, match=said + r".*multi_hot_to_ids"):  # float labels too
        cut_binary_crossentropy(hidden, table, labels.astype("float32"))
    # Converted, they give Keras's dense BCE of the labels.
    ids = multi_hot_to_ids(labels)
    assert ids.dtype == np.int32 and ids.shape == (6, 3, 2)
    got = to_numpy(cut_binary_crossentropy(hidden, table, ids))
    np.testing.assert_allclose(got, dense_bce(hidden, table, labels), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_multi_hot_labels_stop_fit_on_every_backend():
    """Inside `fit` the loss refuses them (the shape decides where the step is traced)."""
    model, items = model_and_items()
    model.compile(optimizer="sgd", loss=CutBCELoss(items, chunk_size=8),
                  metrics=[TopKRetrieval(items, k=3)])
    x, y = data()
    before = weights_of(model)
    with pytest.raises(ValueError, match=r"`(target_ids|y_true)` looks like multi-hot labels"):
        model.fit(x, multi_hot(y), epochs=1, verbose=0)
    for a, b in zip(before, weights_of(model)):
        np.testing.assert_array_equal(a, b)
    history = model.fit(x, multi_hot_to_ids(multi_hot(y)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def _fit_losses(model, x, y, epochs=1):
    history = model.fit(x, y, batch_size=3, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"]


def _adam_model(loss_class):
    model, items = model_and_items()
    model.compile(optimizer="adam", loss=loss_class(items, chunk_size=8),
                  metrics=[TopKRetrieval(items, k=3)])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("loss_class", [CutBCELoss, CutSoftmaxLoss])
def test_a_refused_first_fit_leaves_the_model_usable(loss_class):
    """TensorFlow traced the refused step into `fit`'s cached function; the next `fit` failed ("Creating variables")."""
    x, y = data()
    model = _adam_model(loss_class)
    before = weights_of(model)
    with pytest.raises(ValueError, match=r"`(target_ids|y_true)` looks like multi-hot labels"):
        model.fit(x, multi_hot(y), epochs=1, verbose=0)
    for a, b in zip(before, weights_of(model)):
        np.testing.assert_array_equal(a, b)
    losses = _fit_losses(model, x, y)
    np.testing.assert_allclose(losses, _fit_losses(_adam_model(loss_class), x, y), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loss_class", [CutBCELoss, CutSoftmaxLoss])
def test_a_refused_fit_after_training_leaves_the_model_usable(loss_class):
    """JAX purged the model's variables for the refused step ("'NoneType' object is not callable" next)."""
    x, y = data()
    model = _adam_model(loss_class)
    first = _fit_losses(model, x, y)
    trained = weights_of(model)
    with pytest.raises(TypeError, match=r"`target_ids` must be (an )?integer.*dtype=bool"):
        model.fit(x, multi_hot(y) > 0, epochs=1, verbose=0)  # refused inside the step
    for a, b in zip(trained, weights_of(model)):
        np.testing.assert_array_equal(a, b)
    losses = first + _fit_losses(model, x, y)
    np.testing.assert_allclose(losses, _fit_losses(_adam_model(loss_class), x, y, epochs=2), rtol=1e-5)
    model.evaluate(x, y, verbose=0)


def test_v_item_ids_a_position_pass_where_their_values_are_read():
    """L == V ids holding other values than 0/1 are ids: accepted by the op (values read)."""
    _, items = model_and_items()
    table = to_numpy(items.embeddings).astype("float32")
    rng = np.random.default_rng(1)
    ids = rng.integers(-1, VOCAB, size=(2, VOCAB))
    ids[:, 0] = 7
    hidden = rng.normal(size=(2, DIM)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(cut_binary_crossentropy(hidden, table, ids)),
        to_numpy(cut_binary_crossentropy(hidden, table, np.pad(ids, ((0, 0), (0, 1)), constant_values=-1))),
        rtol=1e-6,
    )


def test_multi_hot_to_ids_options_and_errors():
    labels = np.array([[[1, 0, 1, 1], [0, 0, 0, 0]]], bool)
    np.testing.assert_array_equal(multi_hot_to_ids(labels), [[[0, 2, 3], [-1, -1, -1]]])
    np.testing.assert_array_equal(
        multi_hot_to_ids(keras.ops.convert_to_tensor(labels.astype("float32")), max_ids=4),
        [[[0, 2, 3, -1], [-1, -1, -1, -1]]],
    )
    with pytest.raises(ValueError, match="`max_ids` must be at least the most items a position has"):
        multi_hot_to_ids(labels, max_ids=2)
    with pytest.raises(ValueError, match="soft labels have no ids"):
        multi_hot_to_ids(np.array([[0.9, 0.1]]))


# -- 6. exclude_ids name their axis ------------------------------------------------------


def test_exclude_ids_per_position_need_their_axis():
    _, items = model_and_items()
    x, _ = data()
    hidden = np.random.default_rng(2).normal(size=(6, 3, DIM)).astype("float32")
    with pytest.raises(ValueError, match=r"`exclude_ids` must have shape \[\.\.\., X\].*"
                       r"seen_items\(sequences\).*Received: exclude_ids\.shape=\(6, 3\)"):
        cut_top_k(hidden, items, 5, exclude_ids=x)
    with pytest.raises(ValueError, match=r"`exclude_ids` must have shape \[\.\.\., X\]"):
        TopKRetrieval(items, k=2).update_state(np.zeros((6, 3, 1), "int32"), hidden, exclude_ids=x)
    # Each position's own input id, on its own axis; the history seen up to each position.
    _, own = cut_top_k(hidden, items, VOCAB - 1, exclude_ids=x[..., None])
    _, history = cut_top_k(hidden, items, VOCAB - 3, exclude_ids=seen_items(x))
    own, history = to_numpy(own), to_numpy(history)
    for b, t in np.ndindex(6, 3):
        assert x[b, t] not in own[b, t]
        assert not set(x[b, : t + 1]) & set(history[b, t])
    everything = to_numpy(seen_items(keras.ops.convert_to_tensor(x), causal=False))
    np.testing.assert_array_equal(everything, np.broadcast_to(x[:, None, :], (6, 3, 3)))


# -- 7. ReversibleEmbedding ----------------------------------------------------------------


def reversible_model(**options):
    keras.utils.set_random_seed(0)
    items = keras.layers.ReversibleEmbedding(
        VOCAB, DIM, name="items", embeddings_initializer=keras.initializers.RandomNormal(), **options
    )
    inputs = keras.Input((3,), dtype="int32")
    hidden = keras.layers.Dense(DIM, name="proj")(items(inputs))
    return keras.Model(inputs, hidden), items


@pytest.mark.parametrize("tie_weights", [True, False])
def test_reversible_embedding_scores_with_its_reverse_projection(tie_weights):
    model, items = reversible_model(tie_weights=tie_weights)
    x, y = data()
    hidden = model.predict(x, verbose=0)
    logits = to_numpy(items(keras.ops.convert_to_tensor(hidden), reverse=True))
    want = to_numpy(keras.losses.binary_crossentropy(
        keras.ops.convert_to_tensor(multi_hot(y).astype("float32")),
        keras.ops.convert_to_tensor(logits.astype("float32")), from_logits=True))
    got = to_numpy(cut_binary_crossentropy(hidden, items, y))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _, top = cut_top_k(hidden, items, 4)
    order = np.argsort(-logits, axis=-1, kind="stable")[..., :4]
    np.testing.assert_array_equal(to_numpy(top), order)


@pytest.mark.slow
def test_untied_reversible_embedding_trains_its_output_projection(tmp_path):
    """One SGD step with CutBCELoss equals one with Keras's BCE on `reverse=True` logits."""
    model, items = reversible_model(tie_weights=False)
    x, y = data()
    dense = keras.Model(model.input, items(model.output, reverse=True))
    start = weights_of(model)
    model.compile(optimizer="sgd", loss=CutBCELoss(items, chunk_size=8))
    model.train_on_batch(x, y)
    ours = weights_of(model)
    for variable, value in zip(model.trainable_variables, start):
        variable.assign(value)
    dense.compile(optimizer="sgd", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    dense.train_on_batch(x, multi_hot(y).astype("float32"))
    names = [v.path for v in model.trainable_variables]
    assert any("reverse_embeddings" in n for n in names)
    for name, a, b, before in zip(names, ours, weights_of(dense), start):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
        if "reverse_embeddings" in name:
            assert np.abs(a - before).max() > 0
    # Saved and loaded, the loss reads the loaded layer's output projection.
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0),
                               rtol=1e-5)


def test_logit_soft_cap_is_refused():
    model, items = reversible_model(logit_soft_cap=2.0)
    x, y = data()
    hidden = model.predict(x, verbose=0)
    said = r"`embeddings` layer 'items' caps its logits \(`logit_soft_cap=2.0`"
    with pytest.raises(ValueError, match=said):
        cut_binary_crossentropy(hidden, items, y)
    with pytest.raises(ValueError, match=said):
        CutBCELoss(items)(y, hidden)
    with pytest.raises(ValueError, match=said):
        TopKRetrieval(items, k=2).update_state(y, hidden)


# -- 8. messages ----------------------------------------------------------------------------


def test_a_wrong_target_shape_is_reported_as_passed():
    hidden = np.zeros((4, 5, 8), "float32")
    table = np.zeros((10, 8), "float32")
    with pytest.raises(ValueError, match=r"\(4, 5, 'L'\)\. Received: target_ids\.shape=\(4, 7\)$"):
        cut_binary_crossentropy(hidden, table, np.zeros((4, 7), "int32"))
