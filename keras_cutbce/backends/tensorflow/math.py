"""TensorFlow's loss families (`BCE`, `Softmax`) and BCE's per-logit helpers (as `backends/jax/math.py`)."""

from typing import NamedTuple, Optional

import tensorflow as tf


def exp_neg_abs(z):
    return tf.exp(-tf.abs(z))


def terms(z, minus, plus, *, e=None):
    """`minus * softplus(-z) + plus * softplus(z)`: two non-negative parts, a 0 weight's left out; `e = exp(-|z|)`."""
    log_part = tf.math.log1p(exp_neg_abs(z) if e is None else e)
    out = None
    if minus != 0.0:
        out = tf.maximum(-z, 0.0) + log_part
        out = out if minus == 1.0 else minus * out
    if plus != 0.0:
        part = tf.maximum(z, 0.0) + log_part
        part = part if plus == 1.0 else plus * part
        out = part if out is None else out + part
    return tf.zeros_like(z) if out is None else out


def slopes(z, minus, plus, *, e=None):
    """`plus * sigmoid(z) - minus * sigmoid(-z)`, the derivative of `terms`, with one sigmoid."""
    e = exp_neg_abs(z) if e is None else e
    total = plus + minus
    if minus >= plus:  # the larger weight's sigmoid: exact at any z, a 0 weight drops its part
        sigmoid_neg = tf.where(z >= 0, e, tf.ones_like(e)) / (1.0 + e)
        out = -total * sigmoid_neg
        return out if plus == 0.0 else out + plus
    sigmoid_pos = tf.where(z >= 0, tf.ones_like(e), e) / (1.0 + e)
    out = sigmoid_pos if total == 1.0 else total * sigmoid_pos
    return out if minus == 0.0 else out - minus


def drop_masked(values, z, coef):
    """`values` with 0 where the loop put `-inf` (only label smoothing needs it)."""
    if coef.neg_target == 0.0:
        return values
    return tf.where(tf.equal(z, float("-inf")), tf.zeros_like(values), values)


class BCE(NamedTuple):
    """JAX's `math.BCE` on TensorFlow (the protocol: docs/development.md)."""

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False
    linear = 0.0  # the tiles hold the whole background

    def init(self, rows):
        return tf.zeros([rows], tf.float32)

    def merge(self, acc, part):
        return acc + part

    def tile(self, z, stats, *, loss, grad):
        """Returns a tile's `(row part [M] or None, slopes [M, T] or None)`; `-inf` (a positive) adds 0."""
        e = exp_neg_abs(z)
        weights = self.coef.negative_weights
        part = dz = None
        if loss:
            part = tf.reduce_sum(drop_masked(terms(z, *weights, e=e), z, self.coef), axis=1)
        if grad:
            dz = drop_masked(slopes(z, *weights, e=e), z, self.coef)
        return part, dz

    def statistics(self, acc):
        return None  # the slopes need no row statistics

    def positives(self, z, keep, *, loss, grad):
        """Returns the positives' `(terms [M, L] or None, slopes [M, L] or None)`."""
        e = exp_neg_abs(z)
        weights = self.coef.positive_weights
        return (terms(z, *weights, e=e) if loss else None), (slopes(z, *weights, e=e) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        return (acc if positive_rows is None else acc + positive_rows) * _inverse(vocab)

    def row_scale(self, row_weights, keep, vocab):
        scale = row_weights * _inverse(vocab)
        return scale, scale


class Softmax(NamedTuple):
    """JAX's `math.Softmax` on TensorFlow (`keep` is a float32 mask; `vocab` None: unknown when traced, `sized`)."""

    label_smoothing: float
    vocab: Optional[int]

    masks_positives = False
    two_pass = True
    linear = 0.0  # the smoothing's `a / V` is in the tiles' sums and slopes

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

    def finish(self, acc, positive_rows, keep, vocab):
        loss = self.statistics(acc)
        if self.label_smoothing:
            loss = loss - (self.label_smoothing / self.vocab) * acc[2]
        if positive_rows is None:
            return tf.zeros_like(loss)
        return tf.where(tf.reduce_sum(keep, axis=1) > 0, loss + positive_rows, 0.0)

    def row_scale(self, row_weights, keep, vocab):
        scale = tf.where(tf.reduce_sum(keep, axis=1) > 0, row_weights, 0.0)
        return scale, scale


def sized(family, vocab_size):
    """`family` inside a program: a `vocab` field unknown at trace time (None) read from the table."""
    if getattr(family, "vocab", 0) is not None:
        return family
    return family._replace(vocab=tf.cast(vocab_size, tf.float32))


def _inverse(vocab):
    return 1.0 / tf.cast(vocab, tf.float32)


def _rescaled(total, m_old, m_new):
    return tf.where(tf.equal(m_old, float("-inf")), tf.zeros_like(total), total * tf.exp(m_old - m_new))
