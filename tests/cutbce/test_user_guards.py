"""No silent no-ops for a Keras user, on every backend.

1. A trainable item table that is not one of the model's variables: the first
   train step raises a `ValueError` saying so, on every backend. A frozen or
   constant table outside the model trains the model as asked.
2. A constant (NumPy) table is saved in the loss's config: `model.save` and
   `keras.saving.load_model` work, and the reloaded loss gives the same value.
3. Two retrieval metrics of one (default) name in one model log apart, as
   Keras's own metrics do (`auc`, `auc_1`): `hit@1` and `top_k_retrieval_1_hit@1`.
4. `count_out_of_range_ids` lists the ids the loss treats as padding, with counts.
"""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, ThresholdConfusion, TopKRetrieval, count_out_of_range_ids
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
    retrieval = {"hit@1", "recall@1", "ndcg@1"}
    expected = {"loss"} | retrieval | {f"top_k_retrieval_1_{k}" for k in retrieval}
    expected |= {f"top_k_retrieval_1_{m}@2" for m in ("hit", "recall", "ndcg")}
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
    assert set(second.result()) == {f"{m}@{k}" for m in ("hit", "recall", "ndcg") for k in (1, 2)}
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
    with pytest.raises(TypeError, match=r"`ids` must be integer item ids\. Received: ids\.dtype=float"):
        count_out_of_range_ids(np.array([1.0, 2.0]), VOCAB)
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
    per_output = {f"{o}_{m}@1" for o in "ab" for m in ("hit", "recall", "ndcg")}
    assert per_output <= set(logs)
    hidden = model.predict(x, verbose=0)
    for output in "ab":
        alone = TopKRetrieval(items, k=1)
        alone.update_state(y, hidden[output])
        assert logs[f"{output}_ndcg@1"] == pytest.approx(float(to_numpy(alone.result()["ndcg@1"])))
