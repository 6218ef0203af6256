"""The per-logit weights of binary cross-entropy, written once for every backend.

For one logit `z` with smoothed target `y' = y (1 - a) + a / 2` and positive
weight `p`, the loss term is

    minus * softplus(-z) + plus * softplus(z),   minus = p y',  plus = 1 - y'

and its derivative `plus * sigmoid(z) - minus * sigmoid(-z)`
(`keras_cutbce.math.spec` is the float64 table of both, which every
backend's element-wise helpers are tested against). Each part is
non-negative, so neither form cancels at any `|z|`.

The kernels split the vocabulary in two:

- the negatives (`y = 0`), summed densely tile by tile; their term is also
  `neg_scale * softplus(z) - neg_target * z` (`neg_scale = minus + plus`,
  `neg_target = minus = p a / 2`, 0 without label smoothing), so a kernel
  may sum the linear part `neg_target * z` in closed form;
- the positives, which the dense tiles skip (they are masked inside each
  tile, never added and subtracted back), with the weights
  `(pos_minus, pos_plus)`: a positive's loss and gradient keep full float32
  precision at any `|z|` (e.g. `softplus(-100) ~ 3.7e-44`), whatever `V`.
"""

from typing import NamedTuple


class BCECoefficients(NamedTuple):
    """Weights of the loss terms of a negative and of a positive logit.

    Attributes:
        neg_scale: `scale` of a negative (`y = 0`) logit: its term is
            `neg_scale * softplus(z) - neg_target * z`.
        neg_target: `target` of a negative logit.
        pos_minus: weight of `softplus(-z)` in a positive's term (`p y'`).
        pos_plus: weight of `softplus(z)` in a positive's term (`1 - y'`).
    """

    neg_scale: float
    neg_target: float
    pos_minus: float
    pos_plus: float

    @property
    def negative_weights(self):
        """Returns `(minus, plus)` of a negative logit.

        Its term is `minus softplus(-z) + plus softplus(z)`, the same
        function as `neg_scale softplus(z) - neg_target z`.
        """
        return self.neg_target, self.neg_scale - self.neg_target

    @property
    def positive_weights(self):
        """Returns `(minus, plus)` of a positive: `(pos_minus, pos_plus)`."""
        return self.pos_minus, self.pos_plus


def bce_coefficients(label_smoothing=0.0, pos_weight=1.0):
    """Returns the `BCECoefficients` for a label smoothing and a positive weight.

    Example:

    >>> bce_coefficients(0.0, 1.0)
    BCECoefficients(neg_scale=1.0, neg_target=0.0, pos_minus=1.0, pos_plus=0.0)
    """
    a = float(label_smoothing)
    p = float(pos_weight)
    neg_y = a / 2.0
    pos_y = 1.0 - a / 2.0
    return BCECoefficients(
        neg_scale=1.0 + (p - 1.0) * neg_y,
        neg_target=p * neg_y,
        pos_minus=p * pos_y,
        pos_plus=1.0 - pos_y,
    )
