"""The per-logit loss and slope of the Pallas kernel, in few vector ops.

The same function as `keras_cutbce.backends.jax.math` (the float64 spec
table checks both), written for the TPU's vector unit:

- a positive's sign is flipped with one xor (`hits`: the sign bit at the
  positives, else 0): with `f = +-z` (`-z` at a positive),
  `loss = A softplus(f) + B softplus(-f)` and `d loss / d f =
  A sigmoid(f) - B sigmoid(-f)`, where `(A, B)` is `(plus, minus)` of a
  negative and `(minus, plus)` of a positive
  (`keras_cutbce.math.coefficients`); by default `A = 1, B = 0` for both,
  so no per-logit weight is selected. Every part is non-negative: no
  cancellation at any `|z|`, and `d loss / d z` is the slope xor `hits`.
- one `exp`, one `log`, one reciprocal a logit: with `e = exp(-|z|)`,
  `u = 1 + e` (rounded), `log1p(e) = log(u) + (e - (u - 1))`: the second
  part is the rounding error of `u` (exact, `u - 1` being exact), which
  keeps `log1p(e) ~ e` for tiny `e`; the first-order correction's own error
  is below `e` ulps of the result.
"""

import jax.numpy as jnp
from jax import lax

SIGN_BIT = -(2**31)  # int32 with only the sign bit set


def flip(z, hits):
    """Returns `z` with the sign flipped where `hits` (int32) has its sign bit."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(z, jnp.int32) ^ hits, z.dtype)


def _weights(coef):
    """Returns `((A_neg, A_pos), (B_neg, B_pos))` (module docstring)."""
    (neg_minus, neg_plus), (pos_minus, pos_plus) = coef.negative_weights, coef.positive_weights
    return (neg_plus, pos_minus), (neg_minus, pos_plus)


def _is(weight, value):
    """Whether a weight is statically `value` (a Python float, not a per-logit array)."""
    return isinstance(weight, float) and weight == value


def _per_logit(pair, positive):
    neg, pos = pair
    return neg if neg == pos else jnp.where(positive, pos, neg)


class Exps:
    """`e = exp(-|f|)`, `u = 1 + e` and `r = 1 / u` of sign-flipped logits `f`.

    `barrier`: keep XLA from folding `(1 + e) - 1` to `e` (its algebraic
    simplifier does, which would drop `log1p`'s rounding correction); for
    the interpreter. Mosaic keeps the two roundings (and has no barrier).
    """

    def __init__(self, f, barrier=False):
        negative_abs = lax.bitcast_convert_type(  # -|f|: one or (the sign bit set)
            lax.bitcast_convert_type(f, jnp.int32) | SIGN_BIT, f.dtype)
        self.e = jnp.exp(negative_abs)
        self.u = 1.0 + self.e
        if barrier:
            self.u = lax.optimization_barrier(self.u)
        self.r = 1.0 / self.u


def term(f, ex, coef, positive):
    """Returns each logit's loss term `A softplus(f) + B softplus(-f)`.

    Args:
        f: sign-flipped float32 logits (`flip`).
        ex: their `Exps`.
        coef: `keras_cutbce.math.coefficients.BCECoefficients`.
        positive: bool array of `f`'s shape, or None when every weight is
            the same for negatives and positives (`needs_mask`).
    """
    a, b = (_per_logit(w, positive) for w in _weights(coef))
    # log1p(e) = log(u) + the rounding error of u = 1 + e (u - 1 is exact).
    log1p_e = jnp.log(ex.u) + (ex.e - (ex.u - 1.0))
    relu = jnp.maximum(f, 0.0)
    out = relu if _is(a, 1.0) else a * relu
    if not _is(b, 0.0):
        out = out + b * jnp.maximum(-f, 0.0)
    ab = a + b
    return out + (log1p_e if _is(ab, 1.0) else ab * log1p_e)


def slope(f, ex, coef, positive):
    """Returns `d loss / d f` per logit (xor `hits` gives `d loss / d z`)."""
    a, b = (_per_logit(w, positive) for w in _weights(coef))
    nonneg = f >= 0
    sig = jnp.where(nonneg, 1.0, ex.e) * ex.r  # sigmoid(f)
    out = sig if _is(a, 1.0) else a * sig
    if not _is(b, 0.0):
        out = out - b * (jnp.where(nonneg, ex.e, 1.0) * ex.r)  # sigmoid(-f)
    return out


def needs_mask(coef):
    """Whether the weights differ between negatives and positives (a per-logit select)."""
    return any(neg != pos for neg, pos in _weights(coef))


def term_and_slope(z, positive, coef):
    """Returns the loss term and `d loss / d z` of logits `z` (for tests; float32).

    Example:

    >>> import numpy as np
    >>> from keras_cutbce.math.coefficients import bce_coefficients
    >>> z = jnp.array([-100.0, 0.0, 100.0])
    >>> loss, _ = term_and_slope(z, jnp.array([True] * 3), bce_coefficients())
    >>> [round(float(x), 4) for x in loss]
    [100.0, 0.6931, 0.0]
    """
    positive = jnp.broadcast_to(jnp.asarray(positive), z.shape)
    hits = jnp.where(positive, SIGN_BIT, 0).astype(jnp.int32)
    f = flip(z, hits)
    ex = Exps(f, barrier=True)
    mask = positive if needs_mask(coef) else None
    return term(f, ex, coef, mask), flip(slope(f, ex, coef, mask), hits)
