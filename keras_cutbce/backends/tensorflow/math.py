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

from typing import NamedTuple

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


class BCE(NamedTuple):
    """Binary cross-entropy as the TensorFlow loop's loss family (the seam: docs/development.md).

    The members of JAX's `math.BCE` (`init`, `merge`, `tile`, `positives`,
    `finish`, `row_scale`, `masks_positives`, `two_pass`), plus `scale`: the
    constant factor of every slope (`1 / V`), which the loop applies after
    its matmuls (see `kernel._tile_pass`).
    """

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False

    def init(self, rows):
        return tf.zeros([rows], tf.float32)

    def merge(self, acc, part):
        return acc + part

    def tile(self, z, stats, *, loss, grad):
        """Returns a tile's `(row part [M] or None, slopes [M, T] or None)`; `-inf` (a positive) adds 0."""
        from keras_cutbce.backends.tensorflow.positives import drop_masked

        e = exp_neg_abs(z)
        weights = self.coef.negative_weights
        part = dz = None
        if loss:
            part = tf.reduce_sum(drop_masked(terms(z, e, *weights), z, self.coef), axis=1)
        if grad:
            dz = drop_masked(slopes(z, e, *weights), z, self.coef)
        return part, dz

    def positives(self, z, keep, *, loss, grad):
        """Returns the positives' `(terms [M, L] or None, slopes [M, L] or None)`."""
        e = exp_neg_abs(z)
        weights = self.coef.positive_weights
        return (terms(z, e, *weights) if loss else None), (slopes(z, e, *weights) if grad else None)

    def scale(self, vocab_size):
        return 1.0 / tf.cast(vocab_size, tf.float32)

    def finish(self, acc, positive_rows, keep, scale):
        return (acc if positive_rows is None else acc + positive_rows) * scale

    def row_scale(self, row_weights, keep):
        return row_weights


class Softmax(NamedTuple):
    """Softmax cross-entropy as the TensorFlow loop's loss family (the seam: docs/development.md).

    The math of JAX's `math.Softmax`: the rows' `(max, sum exp(z - max),
    sum z)` merged by rescaling, slopes `exp(z - lse) - a / V` after a first
    pass (`two_pass`), the positives' linear `-(1 - a) / |P| z_p`, no slope
    factor (`scale` 1). `keep` is the float32 mask of the valid ids.
    """

    label_smoothing: float
    vocab: int

    masks_positives = False
    two_pass = True

    def init(self, rows):
        zeros = tf.zeros([rows], tf.float32)
        return (tf.fill([rows], float("-inf")), zeros, zeros)

    def merge(self, acc, part):
        (m1, s1, t1), (m2, s2, t2) = acc, part
        m = tf.maximum(m1, m2)
        return m, _rescaled(s1, m1, m) + _rescaled(s2, m2, m), t1 + t2

    def tile(self, z, stats, *, loss, grad):
        """Returns a tile's `((max, sum exp, sum z) or None, slopes [M, T] or None)`."""
        part = dz = None
        if loss:
            m = tf.reduce_max(z, axis=1)
            total = tf.reduce_sum(z, axis=1) if self.label_smoothing else tf.zeros_like(m)
            part = (m, tf.reduce_sum(tf.exp(z - m[:, None]), axis=1), total)
        if grad:
            dz = tf.exp(z - stats[:, None])
            if self.label_smoothing:
                dz = dz - self.label_smoothing / self.vocab
        return part, dz

    def statistics(self, acc):
        return acc[0] + tf.math.log(acc[1])

    def positives(self, z, keep, *, loss, grad):
        weight = -(1.0 - self.label_smoothing) / tf.maximum(
            tf.reduce_sum(keep, axis=1, keepdims=True), 1.0)
        return (weight * z if loss else None), (weight * tf.ones_like(z) if grad else None)

    def scale(self, vocab_size):
        return 1.0

    def finish(self, acc, positive_rows, keep, scale):
        loss = self.statistics(acc)
        if self.label_smoothing:
            loss = loss - (self.label_smoothing / self.vocab) * acc[2]
        if positive_rows is None:
            return tf.zeros_like(loss)
        return tf.where(tf.reduce_sum(keep, axis=1) > 0, loss + positive_rows, 0.0)

    def row_scale(self, row_weights, keep):
        return tf.where(tf.reduce_sum(keep, axis=1) > 0, row_weights, 0.0)


def _rescaled(total, m_old, m_new):
    """`total * exp(m_old - m_new)`, 0 for an empty total (no `-inf - -inf`)."""
    return tf.where(tf.equal(m_old, float("-inf")), tf.zeros_like(total), total * tf.exp(m_old - m_new))
