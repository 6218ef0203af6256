"""`OutOfRangeTargets`: the target ids the loss ignores (beyond the padding id), in the logs.

Checked against `count_out_of_range_ids` and NumPy, standalone and as a
compiled metric of `fit` / `evaluate` on the active backend, with a batch
that has no valid target at all.
"""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, OutOfRangeTargets, count_out_of_range_ids
from tests.backend_utils import to_numpy

VOCAB, DIM = 11, 4
KEYS = ("out_of_range_ids", "positions_without_targets", "batches_without_targets")


def counts(metric):
    return {k: float(to_numpy(v)) for k, v in metric.result().items()}


def numpy_counts(batches, vocab=VOCAB, padding=-1):
    ignored = empty_rows = empty_batches = 0
    for ids in batches:
        rows = ids.reshape(-1, ids.shape[-1])
        valid = (rows >= 0) & (rows < vocab)
        ignored += int(np.sum(~valid & (rows != padding)))
        empty_rows += int(np.sum(~valid.any(-1)))
        empty_batches += int(not valid.any())
    return dict(zip(KEYS, (ignored, empty_rows, empty_batches)))


def test_counts_match_numpy_and_count_out_of_range_ids(rng):
    metric = OutOfRangeTargets(VOCAB)
    batches = [rng.integers(-1, VOCAB + 3, size=(4, 5, 3)) for _ in range(3)]
    batches.append(np.full((4, 5, 3), -1))  # a batch without any valid target
    for ids in batches:
        metric.update_state(ids)
    want = numpy_counts(batches)
    assert want["out_of_range_ids"] > 0 and want["batches_without_targets"] == 1
    assert counts(metric) == want
    listed = count_out_of_range_ids(np.concatenate(batches), VOCAB)
    assert counts(metric)["out_of_range_ids"] == sum(c for i, c in listed.items() if i != -1)
    metric.reset_state()
    assert counts(metric) == dict.fromkeys(KEYS, 0.0)


def test_padding_id_choice_and_wide_ids():
    ids = np.array([[0, -1, VOCAB], [-2, 2**32 + 1, -1]], "int64")  # 2**32 + 1 would wrap to 1
    default = OutOfRangeTargets(VOCAB)
    default.update_state(ids)
    assert counts(default) == dict(zip(KEYS, (3.0, 1.0, 0.0)))
    every = OutOfRangeTargets(VOCAB, padding_id=None)
    every.update_state(keras.ops.convert_to_tensor(np.array([[0, -1], [-2, VOCAB + 3]], "int32")))
    assert counts(every) == dict(zip(KEYS, (3.0, 1.0, 0.0)))
    padded_with_v = OutOfRangeTargets(VOCAB, padding_id=VOCAB)
    padded_with_v.update_state(np.array([[VOCAB + 1, VOCAB]]))
    assert counts(padded_with_v) == dict(zip(KEYS, (1.0, 1.0, 1.0)))


def test_one_id_a_position_masks_and_weights(rng):
    from keras.src.backend.common.masking import set_keras_mask

    hidden = keras.ops.convert_to_tensor(rng.normal(size=(2, 3, DIM)).astype("float32"))
    ids = np.array([[1, VOCAB + 4, -1], [VOCAB, 2, -1]], "int32")  # [B, T]: one id a position
    metric = OutOfRangeTargets(VOCAB)
    metric.update_state(ids, hidden)
    assert counts(metric) == dict(zip(KEYS, (2.0, 4.0, 0.0)))
    masked = OutOfRangeTargets(VOCAB)
    set_keras_mask(hidden, keras.ops.convert_to_tensor(np.array([[1, 1, 0], [1, 1, 0]], bool)))
    masked.update_state(ids, hidden, sample_weight=np.array([1.0, 0.0]))  # example 1 weighs 0
    assert counts(masked) == dict(zip(KEYS, (1.0, 1.0, 0.0)))


def test_table_sources_and_config():
    items = keras.layers.Embedding(VOCAB, DIM)  # V known before the layer is built
    assert OutOfRangeTargets(items).vocab_size() == VOCAB
    table = keras.Variable(np.zeros((VOCAB, DIM), "float32"))
    metric = OutOfRangeTargets(table, padding_id=-2, name="ignored")
    config = metric.get_config()
    assert config["embeddings"] == VOCAB and config["padding_id"] == -2
    clone = OutOfRangeTargets.from_config(config)
    clone.update_state(np.array([[VOCAB, -2]]))
    assert counts(clone) == {"ignored_out_of_range_ids": 1.0,
                             "ignored_positions_without_targets": 1.0,
                             "ignored_batches_without_targets": 1.0}
    with pytest.raises(ValueError, match=r"`embeddings` must be an int >= 1\. Received: embeddings=0"):
        OutOfRangeTargets(0)
    with pytest.raises(TypeError, match=r"`padding_id` must be an int or None\. Received: padding_id=1\.5"):
        OutOfRangeTargets(VOCAB, padding_id=1.5)
    with pytest.raises(ValueError, match=r"`y_true` must be whole-number item ids"):
        OutOfRangeTargets(VOCAB).update_state(np.array([[1.5]]))


@pytest.mark.slow
def test_logged_by_fit_and_evaluate_and_saved(tmp_path):
    keras.utils.set_random_seed(0)
    items = keras.layers.Embedding(VOCAB, DIM, name="items")
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(DIM)(items(inputs)))
    model.compile(optimizer="sgd", loss=CutBCELoss(items, chunk_size=8),
                  metrics=[OutOfRangeTargets(items)])
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(8, 3)).astype("int32")
    y = rng.integers(-1, VOCAB + 2, size=(8, 3, 2)).astype("int32")  # 1-based-style overflow
    y[4:] = -1  # the second batch of 4 has no valid target at all
    want = numpy_counts([y[:4], y[4:]])
    assert want["out_of_range_ids"] > 0 and want["batches_without_targets"] == 1
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    assert {k: history[k][0] for k in KEYS} == pytest.approx(want)
    logs = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    assert {k: logs[k] for k in KEYS} == pytest.approx(want)
    path = tmp_path / "counted.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    logs = loaded.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    assert {k: logs[k] for k in KEYS} == pytest.approx(want)
