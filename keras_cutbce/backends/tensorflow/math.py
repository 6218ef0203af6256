"""The element-wise math of the TensorFlow kernels: one loss term and one slope.

`terms(z, e, minus, plus)` is `minus * softplus(-z) + plus * softplus(z)`
and `slopes(z, e, minus, plus)` its derivative `plus * sigmoid(z) - minus *
sigmoid(-z)` (`keras_cutbce.math.coefficients` gives the weights of a
negative and of a positive; `keras_cutbce.math.spec` is the float64 table
they are tested against). Every TensorFlow pass calls these two, for the
dense tiles and for the positives.

What is TensorFlow's own: both take `e = exp(-|z|)` (`exp_neg_abs`),
computed once per logit and shared, and are written as plain element-wise
ops that XLA (`jit_compile=True`) fuses into one pass per tile.
"""

import tensorflow as tf


def exp_neg_abs(z):
    """Returns `exp(-|z|)`, the one exponential `terms` and `slopes` share.

    Example:

    >>> exp_neg_abs(tf.constant([0.0, float("-inf")])).numpy().tolist()
    [1.0, 0.0]
    """
    return tf.exp(-tf.abs(z))


def terms(z, e, minus, plus):
    """Returns `minus * softplus(-z) + plus * softplus(z)` from `e = exp(-|z|)`.

    Written `minus * (max(-z, 0) + log1p(e)) + plus * (max(z, 0) +
    log1p(e))`: each part non-negative, finite for any finite `z`; a part
    whose weight is 0 is left out (so `z = -inf` with `minus = 0` gives
    exactly 0).

    Args:
        z: float32 logits, any shape.
        e: `exp_neg_abs(z)`.
        minus: Python float, the weight of `softplus(-z)`.
        plus: Python float, the weight of `softplus(z)`.

    Returns:
        A tensor like `z`.

    Example:

    >>> z = tf.constant([float("-inf"), 0.0, 100.0])
    >>> terms(z, exp_neg_abs(z), 0.0, 1.0).numpy().tolist()
    [0.0, 0.6931471824645996, 100.0]
    """
    log_part = tf.math.log1p(e)
    out = None
    if minus != 0.0:
        out = tf.maximum(-z, 0.0) + log_part
        out = out if minus == 1.0 else minus * out
    if plus != 0.0:
        part = tf.maximum(z, 0.0) + log_part
        part = part if plus == 1.0 else plus * part
        out = part if out is None else out + part
    return tf.zeros_like(z) if out is None else out


def slopes(z, e, minus, plus):
    """Returns `plus * sigmoid(z) - minus * sigmoid(-z)` from `e = exp(-|z|)`.

    With one sigmoid, that of the larger weight's side: `plus - (plus +
    minus) * sigmoid(-z)` when `minus >= plus`, else `(plus + minus) *
    sigmoid(z) - minus`. So a weight of 0 drops its part exactly, and the
    result is exact to float32 resolution at any `z` (a negative's
    `sigmoid(-30) ~ 9e-14` is not lost as `1 - sigmoid(30)` would lose it).

    Args:
        z: float32 logits, any shape.
        e: `exp_neg_abs(z)`.
        minus: Python float, the weight of `sigmoid(-z)`.
        plus: Python float, the weight of `sigmoid(z)`.

    Returns:
        A tensor like `z`.

    Example:

    >>> z = tf.constant([float("-inf"), 0.0])
    >>> slopes(z, exp_neg_abs(z), 1.0, 0.0).numpy().tolist()
    [-1.0, -0.5]
    """
    total = plus + minus
    if minus >= plus:
        sigmoid_neg = tf.where(z >= 0, e, tf.ones_like(e)) / (1.0 + e)
        out = -total * sigmoid_neg
        return out if plus == 0.0 else out + plus
    sigmoid_pos = tf.where(z >= 0, tf.ones_like(e), e) / (1.0 + e)
    out = sigmoid_pos if total == 1.0 else total * sigmoid_pos
    return out if minus == 0.0 else out - minus
