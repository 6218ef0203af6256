"""JAX's loss families (`BCE`, `Softmax`) and BCE's per-logit helpers, in float32.

`terms` / `slopes(z, minus, plus, *, e=None)` on every backend (tested
against `keras_cutbce.math.spec`); the Pallas kernel has its own
(`pallas/kernel.py`) and takes these families' parts outside the kernel.
"""

from typing import NamedTuple

import jax.numpy as jnp


def exp_neg_abs(z):
    return jnp.exp(-jnp.abs(z))


def terms(z, minus, plus, *, e=None):
    """`minus * softplus(-z) + plus * softplus(z)`: two non-negative parts, a 0 weight's left out; `e = exp(-|z|)`."""
    log_part = jnp.log1p(exp_neg_abs(z) if e is None else e)
    out = None
    if minus != 0.0:
        out = jnp.maximum(-z, 0.0) + log_part
        out = out if minus == 1.0 else minus * out
    if plus != 0.0:
        part = jnp.maximum(z, 0.0) + log_part
        part = part if plus == 1.0 else plus * part
        out = part if out is None else out + part
    return jnp.zeros_like(z) if out is None else out


def slopes(z, minus, plus, *, e=None):
    """`plus * sigmoid(z) - minus * sigmoid(-z)`, the derivative of `terms`, with one sigmoid."""
    e = exp_neg_abs(z) if e is None else e
    r = 1.0 / (1.0 + e)
    total = plus + minus
    if minus >= plus:  # the larger weight's sigmoid: exact at any z, a 0 weight drops its part
        out = -total * jnp.where(z >= 0, e * r, r)  # sigmoid(-z)
        return out if plus == 0.0 else out + plus
    out = jnp.where(z >= 0, r, e * r)  # sigmoid(z)
    out = out if total == 1.0 else total * out
    return out if minus == 0.0 else out - minus


class BCE(NamedTuple):
    """Binary cross-entropy as a loop's loss family (the protocol: docs/development.md); hashable."""

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False
    linear = 0.0  # the tiles hold the whole background

    def init(self, rows):
        return jnp.zeros((rows,), jnp.float32)

    def merge(self, acc, part):
        return acc + part

    def tile(self, z, stats, *, loss, grad):
        """A tile's `(row part [M] | None, slopes [M, T] | None)`; `-inf` (a positive) adds 0."""
        e, weights = exp_neg_abs(z), self.coef.negative_weights
        part = jnp.sum(_drop_masked(terms(z, *weights, e=e), z, self.coef), axis=1) if loss else None
        dz = _drop_masked(slopes(z, *weights, e=e), z, self.coef) if grad else None
        return part, dz

    def statistics(self, acc):
        return None  # the slopes need no row statistics

    def positives(self, z, keep, *, loss, grad):
        """The positives' `(terms [M, L] | None, slopes [M, L] | None)`."""
        e, weights = exp_neg_abs(z), self.coef.positive_weights
        return (terms(z, *weights, e=e) if loss else None,
                slopes(z, *weights, e=e) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        return (acc if positive_rows is None else acc + positive_rows) / vocab

    def row_scale(self, row_weights, keep, vocab):
        scale = row_weights / vocab
        return scale, scale


def _drop_masked(values, z, coef):
    if coef.neg_target == 0.0:
        return values
    return jnp.where(z == -jnp.inf, 0.0, values)


class Softmax(NamedTuple):
    """Softmax cross-entropy as a loop's loss family (docs/development.md); hashable.

    The tiles reduce to `(max, sum exp(z - max), sum z)`, merged by
    rescaling; the slopes `exp(z - lse) - a / V` need the first pass's `lse`.
    `closed_form`: the smoothing's `-(a / V) sum_v z_v` is `linear` instead
    (the sharded path, whose padded rows' `-inf` logits it must not sum).
    """

    label_smoothing: float
    vocab: int
    closed_form: bool = False

    masks_positives = False
    two_pass = True

    @property
    def linear(self):
        return self.label_smoothing / self.vocab if self.closed_form else 0.0

    @property
    def _smoothed_tiles(self):
        return bool(self.label_smoothing) and not self.closed_form

    def init(self, rows):
        zeros = jnp.zeros((rows,), jnp.float32)
        return (jnp.full((rows,), -jnp.inf, jnp.float32), zeros, zeros)

    def merge(self, acc, part):
        (m1, s1, t1), (m2, s2, t2) = acc, part
        m = jnp.maximum(m1, m2)
        return m, _rescaled(s1, m1, m) + _rescaled(s2, m2, m), t1 + t2

    def tile(self, z, stats, *, loss, grad):
        """A tile's `((max, sum exp, sum z) | None, slopes [M, T] | None)`."""
        part = dz = None
        if loss:
            m = jnp.max(z, axis=1)
            total = jnp.sum(z, axis=1) if self._smoothed_tiles else jnp.zeros_like(m)
            part = (m, jnp.sum(jnp.exp(z - m[:, None]), axis=1), total)
        if grad:
            dz = jnp.exp(z - stats[:, None])
            if self._smoothed_tiles:
                dz = dz - self.label_smoothing / self.vocab
        return part, dz

    def statistics(self, acc):
        return acc[0] + jnp.log(acc[1])

    def positives(self, z, keep, *, loss, grad):
        """The positives' `(terms, slopes)`: `-(1 - a) / |P| z_p` and its slope."""
        weight = -(1.0 - self.label_smoothing) / _count(keep)
        return (weight * z if loss else None), (jnp.broadcast_to(weight, z.shape) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        loss = self.statistics(acc)
        if self._smoothed_tiles:
            loss = loss - (self.label_smoothing / vocab) * acc[2]
        if positive_rows is None:
            return jnp.zeros_like(loss)
        return jnp.where(jnp.any(keep, axis=1), loss + positive_rows, 0.0)

    def row_scale(self, row_weights, keep, vocab):
        scale = jnp.where(jnp.any(keep, axis=1), row_weights, 0.0)
        return scale, scale


def _rescaled(total, m_old, m_new):
    return jnp.where(m_old == -jnp.inf, 0.0, total * jnp.exp(m_old - m_new))


def _count(keep):
    return jnp.maximum(jnp.sum(keep, axis=1, keepdims=True), 1).astype(jnp.float32)
