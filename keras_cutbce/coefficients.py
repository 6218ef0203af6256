"""The per-logit weights of binary cross-entropy, written once for every backend.

For one logit `z` with smoothed target `y' = y (1 - a) + a / 2` and positive
weight `p`, the loss term is `scale * softplus(z) - target * z` and its
derivative is `scale * sigmoid(z) - target`, with `scale = 1 + (p - 1) y'` and
`target = p y'`. Every vocabulary entry gets the negative weights (`y = 0`);
the positives add a sparse correction `(delta_scale, delta_target)`.
"""

from typing import NamedTuple


class BCECoefficients(NamedTuple):
    """Weights of `scale * softplus(z) - target * z` per logit.

    Attributes:
        neg_scale: `scale` of a negative (`y = 0`) logit.
        neg_target: `target` of a negative logit.
        delta_scale: what a positive adds to `scale`.
        delta_target: what a positive adds to `target`.
    """

    neg_scale: float
    neg_target: float
    delta_scale: float
    delta_target: float


def bce_coefficients(label_smoothing=0.0, pos_weight=1.0):
    """Returns the `BCECoefficients` for a label smoothing and a positive weight.

    Example:

    >>> bce_coefficients(0.0, 1.0)
    BCECoefficients(neg_scale=1.0, neg_target=0.0, delta_scale=0.0, delta_target=1.0)
    """
    a = float(label_smoothing)
    p = float(pos_weight)
    neg_y = a / 2.0
    pos_y = 1.0 - a / 2.0
    neg_scale = 1.0 + (p - 1.0) * neg_y
    neg_target = p * neg_y
    pos_scale = 1.0 + (p - 1.0) * pos_y
    pos_target = p * pos_y
    return BCECoefficients(
        neg_scale, neg_target, pos_scale - neg_scale, pos_target - neg_target
    )
