"""What `EraseModel` tells its user (every backend): a frozen tower, a shared tower's log,
torch-only schedules on JAX and TensorFlow."""

import warnings

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock, EraseModel
from keras_erase.frozen_upstream import FrozenUpstreamWarning
from tests.backend_utils import BACKEND, to_numpy

DISPATCH = "threaded" if BACKEND == "torch" else "auto"  # torch: the ERASE step


def _data(n=32, dim=6):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _fit(model, x, y, epochs=1, batch_size=8, lr=0.1):
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="binary_crossentropy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    frozen = [str(w.message) for w in caught if issubclass(w.category, FrozenUpstreamWarning)]
    return history.history, frozen


@pytest.mark.parametrize("loss_weight, frozen_expected", [(0, True), (0.5, False)])
def test_zero_loss_weight_warns_like_a_block_without_loss(loss_weight, frozen_expected):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    block = DetachBlock(keras.layers.Dense(4, name="tower_dense"), head=keras.layers.Dense(1),
                        loss=keras.losses.BinaryCrossentropy(from_logits=True),
                        loss_weight=loss_weight, name="tower")
    outputs = keras.layers.Dense(1, "sigmoid", name="top")(block(inputs))
    model = EraseModel(inputs, outputs, dispatch=DISPATCH)
    x, y = _data()
    before = to_numpy(model.get_layer("tower").layer.kernel)
    history, frozen = _fit(model, x, y)
    after = to_numpy(model.get_layer("tower").layer.kernel)
    assert "tower_loss" in history  # the local loss is still computed and logged
    if frozen_expected:
        assert len(frozen) == 1
        assert "tower_dense/kernel'" in frozen[0]
        assert "loss_weight > 0" in frozen[0]
        assert "'tower'" in frozen[0] and "loss_weight=0" in frozen[0]
        np.testing.assert_array_equal(after, before)  # the warning tells the truth
    else:
        assert frozen == []
        assert not np.array_equal(after, before)


def test_a_tower_called_twice_logs_the_sum_of_its_local_losses():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    tower = DetachBlock(keras.layers.Dense(4), head=keras.layers.Dense(1),
                        loss=keras.losses.BinaryCrossentropy(from_logits=True),
                        loss_weight=1.0, name="shared")
    hidden = keras.layers.Concatenate()([tower(a), tower(b)])
    model = EraseModel([a, b], keras.layers.Dense(1, "sigmoid")(hidden), dispatch=DISPATCH)
    xa, y = _data()
    xb = -xa[::-1].copy()
    block = model.get_layer("shared")
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    first = float(to_numpy(bce(y, block.head(block.layer(xa)))))
    second = float(to_numpy(bce(y, block.head(block.layer(xb)))))
    assert abs(first - second) > 1e-3  # the two calls' losses differ: sum != 2 x mean
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="binary_crossentropy")
    history = model.fit([xa, xb], y, batch_size=32, epochs=1, verbose=0).history
    np.testing.assert_allclose(history["shared_loss"][0], first + second, rtol=1e-5)


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "streams", "auto", "standard"])
def test_early_backward_schedules_off_torch_say_the_standard_step_runs(dispatch):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EraseModel(inputs, outputs, dispatch=dispatch)
    messages = [str(w.message) for w in caught if "EraseModel:" in str(w.message)]
    if BACKEND == "torch" or dispatch in ("auto", "standard"):
        assert messages == []
    else:
        assert len(messages) == 1
        assert f"dispatch={dispatch!r}" in messages[0]
        assert f"on backend {BACKEND!r} the standard Keras train step runs instead" in messages[0]


def _twice_used_regularized_tower(dispatch):
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    tower = DetachBlock(
        keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.5), name="tower_dense"),
        head=keras.layers.Dense(1), loss=keras.losses.BinaryCrossentropy(from_logits=True),
        loss_weight=1.0, name="shared",
    )
    hidden = keras.layers.Concatenate()([tower(a), tower(b)])
    outputs = keras.layers.Dense(1, "sigmoid", kernel_regularizer=keras.regularizers.L1(0.1))(hidden)
    return EraseModel([a, b], outputs, dispatch=dispatch)


def _regularized_layer_in_two_blocks(dispatch):
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    shared = keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.5), name="shared_dense")
    towers = [
        DetachBlock(
            keras.Sequential([shared, keras.layers.Dense(3, name=f"own_{name}")]),
            head=keras.layers.Dense(1), loss=keras.losses.BinaryCrossentropy(from_logits=True),
            loss_weight=1.0, name=name,
        )
        for name in ("shared", "other")
    ]
    hidden = keras.layers.Concatenate()([towers[0](a), towers[1](b)])
    outputs = keras.layers.Dense(1, "sigmoid", kernel_regularizer=keras.regularizers.L1(0.1))(hidden)
    return EraseModel([a, b], outputs, dispatch=dispatch)


@pytest.mark.parametrize("build", [_twice_used_regularized_tower, _regularized_layer_in_two_blocks],
                         ids=["tower-called-twice", "layer-in-two-blocks"])
def test_a_weight_penalty_is_paid_once_per_step(build):
    """As Keras counts a weight's regularizer once per step, however often its layer is
    called and however many blocks hold it: the ERASE step's loss, logs and weights equal
    the standard step's."""
    xa, y = _data()
    xb = -xa[::-1].copy()
    results = {}
    for dispatch in ("standard", DISPATCH):
        model = build(dispatch)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
        history = model.fit([xa, xb], y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        results[dispatch] = history, [to_numpy(w) for w in model.trainable_weights]
    (want_history, want_weights), (got_history, got_weights) = results.values()
    for key in ("loss", "shared_loss"):
        np.testing.assert_allclose(got_history[key], want_history[key], rtol=1e-5)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
