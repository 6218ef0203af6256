"""The per-logit weights of binary cross-entropy, once: `minus * softplus(-z) + plus * softplus(z)`.

`minus = p y'`, `plus = 1 - y'` for `y' = y (1 - a) + a / 2`; a negative's
term is also `neg_scale softplus(z) - neg_target z` (a closed-form linear part).
"""

from typing import NamedTuple


class BCECoefficients(NamedTuple):
    """The weights of a negative's term (`neg_scale softplus(z) - neg_target z`) and a positive's."""

    neg_scale: float
    neg_target: float
    pos_minus: float
    pos_plus: float

    @property
    def negative_weights(self):
        """`(minus, plus)` of a negative logit."""
        return self.neg_target, self.neg_scale - self.neg_target

    @property
    def positive_weights(self):
        """Returns `(minus, plus)` of a positive: `(pos_minus, pos_plus)`."""
        return self.pos_minus, self.pos_plus


def bce_coefficients(label_smoothing=0.0, pos_weight=1.0):
    """The `BCECoefficients` for a label smoothing and a positive weight."""
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
