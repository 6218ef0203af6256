"""`CutBCELoss` under `tf.distribute.MirroredStrategy` with 2 logical CPU devices.

The test runs this file as a script in a subprocess (logical devices must be
configured before TensorFlow initializes its runtime) and checks that a small
model trained with `CutBCELoss` for a few steps with 2 replicas, each on half
of every batch, logs the same per-step losses and ends with the same weights
as on one device.
"""

import json

import keras
import pytest

from tests.backend_utils import run_child_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute needs KERAS_BACKEND=tensorflow",
)]


def test_cut_bce_loss_trains_under_mirrored_strategy_like_one_device():
    report = run_child_script(__file__, dict(
        KERAS_BACKEND="tensorflow",
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="2",
    ))
    assert report["replicas"] == 2
    assert len(report["losses"]) == 3


# ----------------------------------------------------------------------- child ---


def _build(num_items, dim):
    from keras import layers

    from keras_cutbce import CutBCELoss

    keras.utils.set_random_seed(3)
    ids = keras.Input((None,), dtype="int32")
    items = layers.Embedding(
        num_items, dim, name="items",
        embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0),
    )
    hidden = layers.Dense(dim, activation="tanh", name="mix")(items(ids))
    model = keras.Model(ids, layers.Dense(dim, name="out")(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(2.0),
        loss=CutBCELoss(items, label_smoothing=0.1, chunk_size=16),
    )
    return model


def _train(strategy, x, y, batch, num_items, dim):
    import numpy as np

    with strategy.scope():
        # Keras builds the compiled loss from the replicas' mean of the first
        # batch (float ids): CutBCELoss must accept that build.
        model = _build(num_items, dim)
    initial = [np.array(w) for w in model.weights]
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda step, logs: losses.append(float(logs["loss"]))
    )
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])
    # fit logs a running mean: recover each step's own loss.
    steps = [(i + 1) * m - i * p for i, (m, p) in enumerate(zip(losses, [0.0] + losses))]
    return initial, steps, [np.array(w) for w in model.weights]


def _child():
    import numpy as np
    import tensorflow as tf

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) == 2, devices

    num_items, dim, batch, seq = 70, 8, 8, 5  # 70 items: not a multiple of the tile
    rng = np.random.default_rng(0)
    x = rng.integers(0, num_items, size=(3 * batch, seq)).astype("int32")
    y = rng.integers(-1, num_items + 2, size=(3 * batch, seq, 4)).astype("int32")
    y[:, :, 1] = y[:, :, 0]  # duplicates count once

    one = _train(tf.distribute.OneDeviceStrategy(devices[0]), x, y, batch, num_items, dim)
    mirrored = tf.distribute.MirroredStrategy(devices)
    assert mirrored.num_replicas_in_sync == 2
    two = _train(mirrored, x, y, batch, num_items, dim)
    for a, b in zip(one[0], two[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(two[1], one[1], rtol=1e-5, err_msg="per-step losses")
    assert one[2][0].shape == (num_items, dim)
    for a, b in zip(two[2], one[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg="trained weights")
    # The weights moved well beyond the tolerance, the loss went down.
    for before, after in zip(one[0], one[2]):
        assert np.max(np.abs(after - before)) > 1e-3
    assert one[1][-1] < one[1][0]
    print(json.dumps({"replicas": 2, "losses": two[1]}))


if __name__ == "__main__":
    _child()
