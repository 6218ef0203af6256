"""The float64 spec table: the exact loss and slope of one logit, which every backend's helpers are tested against.

`loss = p y' softplus(-z) + (1 - y') softplus(z)` for `y' = y (1 - a) + a / 2`
(the contract's `(1 + (p - 1) y') softplus(z) - p y' z`); zero weights left out.
"""

from typing import NamedTuple

import numpy as np

LOGITS = (
    -np.inf, -1e4, -1e3, -100.0, -60.0, -30.0, -17.5, -5.0, -1.0, -2.0**-10, 0.0,
    2.0**-10, 1.0, 5.0, 17.5, 30.0, 60.0, 100.0, 1e3, 1e4, np.inf,
)
"""The logits of the table, float64 (all exactly representable in float32)."""

SETTINGS = ((0.0, 1.0), (0.1, 1.0), (0.0, 3.0), (0.2, 2.5))
"""The `(label_smoothing, pos_weight)` pairs of the table."""


class SpecRow(NamedTuple):
    """One row: `logit`, `positive`, `label_smoothing`, `pos_weight`, and the exact `loss` and `slope`."""

    logit: float
    positive: bool
    label_smoothing: float
    pos_weight: float
    loss: float
    slope: float


def term_weights(positive, label_smoothing=0.0, pos_weight=1.0):
    """`(minus, plus)`: the weights of `softplus(-z)` and `softplus(z)`."""
    a, p = float(label_smoothing), float(pos_weight)
    smoothed = 1.0 - a / 2.0 if positive else a / 2.0
    return p * smoothed, 1.0 - smoothed


def softplus(z):
    return np.logaddexp(0.0, np.asarray(z, np.float64))


def sigmoid(z):
    return np.exp(-softplus(-np.asarray(z, np.float64)))


def weighted_terms(z, minus, plus):
    """Float64 `minus * softplus(-z) + plus * softplus(z)`, zero weights left out."""
    z = np.asarray(z, np.float64)
    out = np.zeros_like(z)
    if minus != 0.0:
        out = out + minus * softplus(-z)
    if plus != 0.0:
        out = out + plus * softplus(z)
    return out


def weighted_slopes(z, minus, plus):
    """Float64 `plus * sigmoid(z) - minus * sigmoid(-z)`."""
    z = np.asarray(z, np.float64)
    out = np.zeros_like(z)
    if plus != 0.0:
        out = out + plus * sigmoid(z)
    if minus != 0.0:
        out = out - minus * sigmoid(-z)
    return out


def per_logit(z, positive, label_smoothing=0.0, pos_weight=1.0):
    """The exact float64 `(loss, slope)` of logits `z` (any shape)."""
    minus, plus = term_weights(positive, label_smoothing, pos_weight)
    return weighted_terms(z, minus, plus), weighted_slopes(z, minus, plus)


def table():
    """The spec table: one `SpecRow` per logit, target and setting."""
    rows = []
    for a, p in SETTINGS:
        for positive in (False, True):
            loss, slope = per_logit(np.array(LOGITS), positive, a, p)
            rows += [
                SpecRow(float(z), positive, a, p, float(l), float(s))
                for z, l, s in zip(LOGITS, loss, slope)
            ]
    return rows


# -- softmax cross-entropy ------------------------------------------------------------

SOFTMAX_ROWS = (
    ((0.0, 1.0, 2.0, -1.0), (1,)),
    ((80.0, -80.0, 0.0, 79.5), (1,)),
    ((80.0, -80.0, 0.0, 79.5), (0, 3, 3)),
    ((-100.0, -100.0, -100.0, -100.0), (2,)),
    ((1e3, 0.0, -1e3, 2.0**-10), (2, 1)),
    ((5.0, 4.0, 3.0, 2.0), ()),
)
"""Rows of float32-exact logits `[4]` and their target ids (a repeated id counts once)."""

SOFTMAX_SMOOTHING = (0.0, 0.1, 0.2)
"""The label smoothings of the softmax rows."""


def softmax_row(z, targets, label_smoothing=0.0):
    """The exact float64 `(loss, slopes)` of one row `z` `[V]`: `softmax(z) - y'` slopes, `(0, zeros)` without a target."""
    z = np.asarray(z, np.float64)
    targets = sorted(set(int(t) for t in targets))
    if not targets:
        return 0.0, np.zeros_like(z)
    a = float(label_smoothing)
    y = np.full_like(z, a / z.size)
    y[targets] += (1.0 - a) / len(targets)
    top = np.max(z)
    lse = top + np.log(np.sum(np.exp(z - top)))
    weighted = y > 0  # an item without target weight adds nothing, even at z = -inf
    return float(lse - np.sum(y[weighted] * z[weighted])), np.exp(z - lse) - y
