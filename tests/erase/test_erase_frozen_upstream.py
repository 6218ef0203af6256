"""A trainable upstream that feeds only detached blocks is never silent (every backend).

`EraseModel` warns once, at its first train step, with the variables' paths and
the blocks to build with `detach_input=False` (`keras_erase.frozen_upstream`).
"""

import warnings

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock, EraseModel
from keras_erase.frozen_upstream import FrozenUpstreamWarning, frozen_variables, reached
from tests.backend_utils import BACKEND, to_numpy

DISPATCH = "threaded" if BACKEND == "torch" else "auto"  # torch: the ERASE step


def _embedding_towers(detach_input=True, dispatch=DISPATCH, lossless_block=False):
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int32", name="ids")
    features = keras.layers.Flatten()(keras.layers.Embedding(50, 3, name="emb")(ids))
    towers = [
        DetachBlock(keras.layers.Dense(4, name=f"dense_{i}"), head=keras.layers.Dense(1),
                    loss="mse", detach_input=detach_input, name=f"tower_{i}")(features)
        for i in range(3)
    ]
    if lossless_block:  # detaches, no local loss: its layer never trains
        towers.append(DetachBlock(keras.layers.Dense(2, name="idle"), name="no_loss")(features))
    top = keras.layers.Dense(1, name="top")(keras.layers.Concatenate()(towers))
    model = EraseModel(ids, top, dispatch=dispatch)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 50, (32, 4)).astype("int32"), rng.random((32, 1)).astype("float32")


def _fit_warnings(model, epochs=2):
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0)
    return [str(w.message) for w in caught if issubclass(w.category, FrozenUpstreamWarning)]


def test_embedding_feeding_only_detached_blocks_warns_once_with_paths_and_fix():
    model = _embedding_towers()
    before = to_numpy(model.get_layer("emb").embeddings)
    messages = _fit_warnings(model)
    assert len(messages) == 1  # once, at the first train step (2 epochs, 8 steps)
    message = messages[0]
    assert "'emb/embeddings'" in message
    assert "detach_input=False" in message
    for name in ("tower_0", "tower_1", "tower_2"):
        assert repr(name) in message
    # What the warning is about: the embedding did not move at all.
    np.testing.assert_array_equal(to_numpy(model.get_layer("emb").embeddings), before)


def test_no_warning_when_the_blocks_pass_the_gradient():
    model = _embedding_towers(detach_input=False)
    before = to_numpy(model.get_layer("emb").embeddings)
    assert _fit_warnings(model, epochs=1) == []
    assert np.abs(to_numpy(model.get_layer("emb").embeddings) - before).max() > 0


def test_layer_inside_a_block_without_loss_is_reported_without_readers():
    model = _embedding_towers(lossless_block=True)
    x, y = _data()
    frozen = {v.path: [b.name for b in readers] for v, readers in frozen_variables(model, (x, y))}
    assert frozen["emb/embeddings"] == ["tower_0", "tower_1", "tower_2", "no_loss"]
    idle = {path: readers for path, readers in frozen.items() if "idle" in path}
    assert len(idle) == 2 and all(readers == [] for readers in idle.values()), frozen
    assert set(frozen) == {"emb/embeddings", *idle}  # every other layer trains


def test_the_check_changes_no_state():
    """Weights and logs after training are those of the same model without the check."""

    def train(check):
        model = _embedding_towers(detach_input=False)
        model.get_layer("emb").trainable = True
        if not check:
            model.__dict__["_frozen_upstream_checked"] = True
        for block in model.detach_blocks():
            block.detach_input = True  # the check runs (and finds the embedding)
        x, y = _data()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        return [to_numpy(w) for w in model.weights], history.history

    weights_checked, logs_checked = train(True)
    weights_plain, logs_plain = train(False)
    for a, b in zip(weights_checked, weights_plain):
        np.testing.assert_array_equal(a, b)
    assert logs_checked == logs_plain


def test_reached_follows_stop_gradient():
    ops = keras.ops
    values = [ops.ones((3,)), ops.ones((2, 2)), ops.ones(())]

    def fn(v):
        return [
            ops.sum(v[0] * 2.0) + ops.sum(ops.stop_gradient(v[1])),
            ops.sum(v[1]) * v[2],
            ops.sum(ops.stop_gradient(v[0])),
        ]

    assert reached(fn, values) == [
        [True, False, False],
        [False, True, True],
        [False, False, False],
    ]
