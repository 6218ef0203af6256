"""Eager TensorFlow calls with varying options trace each program once, with no retracing warning.

Every option set (label smoothing, positive weight, tile width, bias or
not, shapes) has its own compiled program; calling the public ops eagerly
with many option sets, and the same options with another batch size, logs
no "triggered tf.function retracing" warning. Runs only under
KERAS_BACKEND=tensorflow.
"""

import logging

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow programs: tensorflow only"
)

# (label_smoothing, pos_weight, chunk_size, batch, vocab, with_bias)
OPTION_SETS = [
    (0.0, 1.0, 16, 5, 37, False),
    (0.1, 1.0, 16, 5, 37, True),
    (0.0, 2.0, 8, 6, 37, False),
    (0.2, 0.5, 32, 4, 41, True),
    (0.05, 3.0, 16, 7, 29, False),
    (0.3, 1.5, 8, 3, 50, True),
]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def tf_warnings():
    import tensorflow as tf

    logger = tf.get_logger()
    records = _Records()
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)


def _call_both(rng, options, batch=None):
    import tensorflow as tf

    import keras_cutbce
    from keras_cutbce import ops as cut_ops

    smoothing, pos_weight, chunk, m, v, with_bias = options
    m = batch or m
    d = 4
    h = tf.constant(rng.normal(size=(m, d)), tf.float32)
    table = tf.constant(rng.normal(size=(v, d)), tf.float32)
    bias = tf.constant(rng.normal(size=(v,)), tf.float32) if with_bias else None
    ids = tf.constant(rng.integers(-1, v, size=(m, 2)))
    weights = tf.constant(rng.uniform(0.5, 1.5, size=(m,)), tf.float32)
    kwargs = dict(label_smoothing=smoothing, pos_weight=pos_weight, chunk_size=chunk)
    with tf.GradientTape() as tape:
        tape.watch([h, table])
        per_row = keras_cutbce.cut_binary_crossentropy(h, table, ids, bias, **kwargs)
        total = cut_ops.weighted_loss_sum(h, table, ids, weights, bias, **kwargs)
    grads = tape.gradient([per_row, total], [h, table])
    assert all(g is not None for g in grads)
    return per_row, total, weights


@pytest.mark.slow  # compiles eight programs
def test_varying_options_log_no_retracing_warning(tf_warnings, rng):
    for options in OPTION_SETS:
        per_row, total, weights = _call_both(rng, options)
        np.testing.assert_allclose(
            float(total), float(np.sum(weights.numpy() * per_row.numpy())), rtol=1e-5
        )
    for options in OPTION_SETS[:2]:  # the same options again, another batch size
        _call_both(rng, options, batch=options[3] + 2)
    assert not [m for m in tf_warnings if "retracing" in m]
