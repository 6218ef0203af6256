"""The float64 spec table: the exact loss and slope of one logit.

Every backend's element-wise helpers are tested against this table
(`tests/cutbce/test_math_spec.py`). For a logit `z` with target `y` (0 for a
negative, 1 for a positive), label smoothing `a` and positive weight `p`,
with `y' = y (1 - a) + a / 2`:

    loss(z)  = p y' softplus(-z) + (1 - y') softplus(z)
    slope(z) = (1 - y') sigmoid(z) - p y' sigmoid(-z)

(`slope = d loss / d z`; the contract's `(1 + (p - 1) y') softplus(z) -
p y' z` is the same function, since `softplus(-z) = softplus(z) - z`). Both
are written as `minus * softplus(-z) + plus * softplus(z)` and
`plus * sigmoid(z) - minus * sigmoid(-z)`, with the two weights of
`term_weights`; each part is non-negative, so the form has no cancellation
at any `|z|`, and a part whose weight is 0 is left out, so the infinite
logits have their limits (`0 * inf` never appears).

The table covers logits from `-inf` through `-1e4`, `0` and `1e4` to
`+inf`, for a negative and a positive logit, without and with label
smoothing and a positive weight.
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
    """One row of the spec table.

    Attributes:
        logit: the logit `z` (float64, may be infinite).
        positive: whether the logit is a positive (`y = 1`).
        label_smoothing: `a`.
        pos_weight: `p`.
        loss: the exact float64 loss of the logit.
        slope: the exact float64 `d loss / d z`.
    """

    logit: float
    positive: bool
    label_smoothing: float
    pos_weight: float
    loss: float
    slope: float


def term_weights(positive, label_smoothing=0.0, pos_weight=1.0):
    """Returns `(minus, plus)`: the weights of `softplus(-z)` and `softplus(z)`.

    `minus = p y'` and `plus = 1 - y'` for the smoothed target `y'` of a
    negative (`positive=False`) or a positive logit.

    Example:

    >>> term_weights(False), term_weights(True)
    ((0.0, 1.0), (1.0, 0.0))
    >>> term_weights(True, label_smoothing=0.2, pos_weight=2.0)
    (1.8, 0.09999999999999998)
    """
    a, p = float(label_smoothing), float(pos_weight)
    smoothed = 1.0 - a / 2.0 if positive else a / 2.0
    return p * smoothed, 1.0 - smoothed


def softplus(z):
    """Returns float64 `log(1 + exp(z))`, exact for any `z`, `+-inf` included.

    Example:

    >>> float(softplus(0.0)) == float(np.log(2.0)), float(softplus(-np.inf))
    (True, 0.0)
    """
    return np.logaddexp(0.0, np.asarray(z, np.float64))


def sigmoid(z):
    """Returns float64 `1 / (1 + exp(-z))`, exact for any `z`, `+-inf` included.

    Example:

    >>> float(sigmoid(0.0)), float(sigmoid(np.inf)), float(sigmoid(-np.inf))
    (0.5, 1.0, 0.0)
    """
    return np.exp(-softplus(-np.asarray(z, np.float64)))


def weighted_terms(z, minus, plus):
    """Returns float64 `minus * softplus(-z) + plus * softplus(z)`, zero weights left out.

    Example:

    >>> float(weighted_terms(-np.inf, 0.0, 1.0)), float(weighted_terms(np.inf, 0.0, 1.0))
    (0.0, inf)
    """
    z = np.asarray(z, np.float64)
    out = np.zeros_like(z)
    if minus != 0.0:
        out = out + minus * softplus(-z)
    if plus != 0.0:
        out = out + plus * softplus(z)
    return out


def weighted_slopes(z, minus, plus):
    """Returns float64 `plus * sigmoid(z) - minus * sigmoid(-z)`, the `d/dz` of `weighted_terms`.

    Example:

    >>> float(weighted_slopes(0.0, 1.0, 0.0)), float(weighted_slopes(-np.inf, 0.0, 1.0))
    (-0.5, 0.0)
    """
    z = np.asarray(z, np.float64)
    out = np.zeros_like(z)
    if plus != 0.0:
        out = out + plus * sigmoid(z)
    if minus != 0.0:
        out = out - minus * sigmoid(-z)
    return out


def per_logit(z, positive, label_smoothing=0.0, pos_weight=1.0):
    """Returns the exact float64 `(loss, slope)` of logits `z` (any shape).

    Example:

    >>> loss, slope = per_logit(np.array([-1e4, 0.0, 1e4]), positive=True)
    >>> loss.tolist(), slope.tolist()
    ([10000.0, 0.6931471805599453, 0.0], [-1.0, -0.5, 0.0])
    """
    minus, plus = term_weights(positive, label_smoothing, pos_weight)
    return weighted_terms(z, minus, plus), weighted_slopes(z, minus, plus)


def table():
    """Returns the spec table: one `SpecRow` per logit, target and setting.

    Example:

    >>> rows = table()
    >>> len(rows) == len(LOGITS) * 2 * len(SETTINGS)
    True
    >>> [r for r in rows if r.logit == 0.0 and r.positive and r.pos_weight == 1.0][0].slope
    -0.5
    """
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
    """Returns the exact float64 `(loss, slopes)` of one row of logits `z` `[V]`.

    `loss = logsumexp(z) - sum_v y'_v z_v` with `y' = (1 - a) multi_hot / |P|
    + a / V` for the distinct targets `P`, and `slopes = softmax(z) - y'`;
    `(0, zeros)` for a row without a target.

    Example:

    >>> loss, slopes = softmax_row([0.0, np.log(2.0), 0.0], [1])
    >>> round(float(loss), 6), [round(float(s), 3) for s in slopes]
    (0.693147, [0.25, -0.5, 0.25])
    """
    z = np.asarray(z, np.float64)
    targets = sorted(set(int(t) for t in targets))
    if not targets:
        return 0.0, np.zeros_like(z)
    a = float(label_smoothing)
    y = np.full_like(z, a / z.size)
    y[targets] += (1.0 - a) / len(targets)
    top = np.max(z)
    lse = top + np.log(np.sum(np.exp(z - top)))
    return float(lse - np.sum(y * z)), np.exp(z - lse) - y
