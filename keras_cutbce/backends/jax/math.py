"""The per-logit math of CutBCE on JAX for the chunked loop, and its loss family `BCE`.

Plain `jax.numpy` functions run in the XLA loop (`chunked`; the Pallas
kernel has its own, `pallas.logit_terms`, and uses `sorted_positives`
from here). The weights come from
`keras_cutbce.math.coefficients.bce_coefficients`; every logit `z` gets one
`exp` and one `log1p`, in float32: with `e = exp(-|z|)`,

    softplus(+-z) = max(+-z, 0) + log1p(e)
    sigmoid(z) = r if z >= 0 else e r,   sigmoid(-z) = e r if z >= 0 else r,
    with r = 1 / (1 + e)

- a negative's term `neg_scale softplus(z) - neg_target z` (with label
  smoothing summed as its two non-negative parts `plus max(z, 0) +
  minus max(-z, 0) + neg_scale log1p(e)`, finite up to `|z| = inf`), slope
  `neg_scale sigmoid(z) - neg_target`;
- a positive's term `pos_minus softplus(-z) + pos_plus softplus(z)` (two
  non-negative parts: no cancellation at any `|z|`), slope
  `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.

`terms` and `slopes` take a `positive` flag (all negatives, all positives,
or a per-logit mask; the chunked loop sums the negatives densely and the
positives apart). A weight that is
statically 0 (or a scale of 1) costs nothing: the coefficients are Python
floats, so the branch is taken at trace time.
"""

from typing import NamedTuple

import jax.numpy as jnp

from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.positives import distinct_targets


def exp_neg_abs(z):
    """Returns `exp(-|z|)`, the one exponential of a logit."""
    return jnp.exp(-jnp.abs(z))


def terms(z, minus, plus, *, e=None):
    """`minus * softplus(-z) + plus * softplus(z)` per logit; `e`: `exp(-|z|)` if already computed.

    Written as two non-negative parts sharing one `log1p(e)`; a part whose
    weight is 0 is left out (so `z = -inf` with `minus = 0` gives exactly 0).

    >>> z = jnp.array([-100.0, 0.0, 100.0])
    >>> [round(float(x), 4) for x in terms(z, 1.0, 0.0)]
    [100.0, 0.6931, 0.0]
    """
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


def sorted_positives(ids, vocab_size):
    """Returns each row's positives sorted ascending, `EMPTY_ID` (first) for the rest.

    The positives are `keras_cutbce.math.positives.distinct_targets` (valid,
    de-duplicated; ids of any integer width); the Pallas kernel finds a
    row's positives inside a vocabulary tile as consecutive entries of this
    array.

    Args:
        ids: integer `[M, L]`.
        vocab_size: int, `V`.

    Returns:
        Int32 `[M, L]`.

    Example:

    >>> import numpy as np
    >>> np.asarray(sorted_positives(np.array([[3, -1, 3, 7, 1]]), 5)).tolist()
    [[-1, -1, -1, 1, 3]]
    """
    safe, keep = distinct_targets(ids, vocab_size)
    return jnp.sort(jnp.where(keep, safe, EMPTY_ID), axis=1)



class BCE(NamedTuple):
    """Binary cross-entropy as the chunked loop's loss family (the seam: docs/development.md).

    The loop (`chunked`) is given a family: what a tile's logits add to the
    rows (`tile`, reduced over tiles by `merge` from `init`), each positive's
    term and slope (`positives`, summed by the loop over the valid ids), the
    rows' loss (`finish`) and the factor of each row's slopes (`row_scale`).
    `masks_positives`: the loop sets each row's positives to `-inf` in its
    tiles (their exact terms come from `positives`); `two_pass`: the slopes
    need the row statistics of a first pass (`statistics`, e.g. a softmax's
    log-sum-exp). Hashable: it keys the compiled functions.
    """

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False

    def init(self, rows):
        """The rows' reduction before the first tile: the loss sums, `[M]` zeros."""
        return jnp.zeros((rows,), jnp.float32)

    def merge(self, acc, part):
        return acc + part

    def tile(self, z, stats, *, loss, grad):
        """Returns a tile's `(row part [M] or None, slopes [M, T] or None)`; `-inf` (a positive) adds 0."""
        e, weights = exp_neg_abs(z), self.coef.negative_weights
        part = jnp.sum(_drop_masked(terms(z, *weights, e=e), z, self.coef), axis=1) if loss else None
        dz = _drop_masked(slopes(z, *weights, e=e), z, self.coef) if grad else None
        return part, dz

    def positives(self, z, keep, *, loss, grad):
        """Returns the positives' `(terms [M, L] or None, slopes [M, L] or None)`; `keep`: valid ids."""
        e, weights = exp_neg_abs(z), self.coef.positive_weights
        return (terms(z, *weights, e=e) if loss else None,
                slopes(z, *weights, e=e) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        """Returns the rows' loss `[M]`: the mean over the vocabulary."""
        return (acc if positive_rows is None else acc + positive_rows) / vocab

    def row_scale(self, row_weights, keep, vocab):
        """Returns the factor of each row's slopes: the row's weight over `V`."""
        return row_weights / vocab


def _drop_masked(values, z, coef):
    """Returns `values` with 0 where the loop put `-inf` (only label smoothing needs it)."""
    if coef.neg_target == 0.0:
        return values
    return jnp.where(z == -jnp.inf, 0.0, values)


class Softmax(NamedTuple):
    """Softmax cross-entropy as the chunked loop's loss family (the seam: docs/development.md).

    A row's loss is `logsumexp(z) - (a / V) sum_v z_v - (1 - a) / |P| sum_{p
    in P} z_p` for its valid, distinct ids `P` and label smoothing `a`; 0
    for a row without a valid id. The tiles reduce each row to `(running
    max, sum exp(z - max), sum z)` (merged by rescaling, never an `exp` of
    an unshifted logit); the slopes `exp(z - lse) - a / V` need the first
    pass's `lse` (`two_pass`). The positives are not masked in the tiles:
    their term is the linear `-(1 - a) / |P| z_p` alone. Hashable.
    """

    label_smoothing: float
    vocab: int

    masks_positives = False
    two_pass = True

    def init(self, rows):
        """`(max, sum exp, sum z)` before the first tile: `(-inf, 0, 0)`, each `[M]`."""
        zeros = jnp.zeros((rows,), jnp.float32)
        return (jnp.full((rows,), -jnp.inf, jnp.float32), zeros, zeros)

    def merge(self, acc, part):
        """Merges two `(max, sum exp, sum z)` by rescaling the sums to the larger max."""
        (m1, s1, t1), (m2, s2, t2) = acc, part
        m = jnp.maximum(m1, m2)
        return m, _rescaled(s1, m1, m) + _rescaled(s2, m2, m), t1 + t2

    def tile(self, z, stats, *, loss, grad):
        """Returns a tile's `((max, sum exp, sum z) or None, slopes [M, T] or None)`."""
        part = dz = None
        if loss:
            m = jnp.max(z, axis=1)
            total = jnp.sum(z, axis=1) if self.label_smoothing else jnp.zeros_like(m)
            part = (m, jnp.sum(jnp.exp(z - m[:, None]), axis=1), total)
        if grad:
            dz = jnp.exp(z - stats[:, None])
            if self.label_smoothing:
                dz = dz - self.label_smoothing / self.vocab
        return part, dz

    def statistics(self, acc):
        """The rows' log-sum-exp `[M]`."""
        return acc[0] + jnp.log(acc[1])

    def positives(self, z, keep, *, loss, grad):
        """Returns the positives' `(terms, slopes)`: `-(1 - a) / |P| z_p` and its slope."""
        weight = -(1.0 - self.label_smoothing) / _count(keep)
        return (weight * z if loss else None), (jnp.broadcast_to(weight, z.shape) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        """Returns the rows' loss `[M]`, 0 for a row without a valid id."""
        loss = self.statistics(acc)
        if self.label_smoothing:
            loss = loss - (self.label_smoothing / vocab) * acc[2]
        if positive_rows is None:
            return jnp.zeros_like(loss)
        return jnp.where(jnp.any(keep, axis=1), loss + positive_rows, 0.0)

    def row_scale(self, row_weights, keep, vocab):
        """Returns the factor of each row's slopes: its weight, 0 without a valid id."""
        return jnp.where(jnp.any(keep, axis=1), row_weights, 0.0)


def _rescaled(total, m_old, m_new):
    """`total * exp(m_old - m_new)`, 0 for an empty total (no `-inf - -inf`)."""
    return jnp.where(m_old == -jnp.inf, 0.0, total * jnp.exp(m_old - m_new))


def _count(keep):
    """Each row's number of valid positives `[M, 1]`, at least 1."""
    return jnp.maximum(jnp.sum(keep, axis=1, keepdims=True), 1).astype(jnp.float32)
