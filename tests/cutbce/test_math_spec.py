"""Every backend's element-wise helpers against the float64 spec table.

`keras_cutbce.math.spec` gives the exact loss and slope of one logit (a
negative and a positive, without and with label smoothing and a positive
weight, logits from -inf through 0 to +inf). Each backend's helpers are
listed once, in `HELPERS`; the suite runs once per Keras backend, and each
run checks the active backend's helpers in float32 (and float64 where the
backend computes in it).
"""

import keras
import numpy as np
import pytest

from keras_cutbce.math import spec
from keras_cutbce.math.coefficients import bce_coefficients

BACKEND = keras.backend.backend()
# A result is within a few units of its last place of the exact value; below
# the smallest normal number of its dtype only the absolute error counts (torch's
# float32 sigmoid(-100) is 0, not the denormal 3.7e-44).
RTOL = {"float32": 8 * 2.0**-24, "float64": 32 * 2.0**-53}
ATOL = {"float32": 2.0**-126, "float64": 2.0**-1022}


def _torch_helpers(dtype):
    import torch

    from keras_cutbce.backends.torch import math

    def run(z, positive, coef):
        weights = coef.positive_weights if positive else coef.negative_weights
        z = torch.as_tensor(z, dtype=getattr(torch, dtype))
        loss = math.terms(z, *weights)
        slope = math.slopes(z, *weights)
        return loss.double().numpy(), slope.double().numpy()

    return run


def _tensorflow_helpers(dtype):
    import tensorflow as tf

    from keras_cutbce.backends.tensorflow import math

    def run(z, positive, coef):
        weights = coef.positive_weights if positive else coef.negative_weights
        z = tf.constant(z, dtype)
        e = math.exp_neg_abs(z)
        loss, slope = math.terms(z, *weights, e=e), math.slopes(z, *weights, e=e)
        return loss.numpy().astype(np.float64), slope.numpy().astype(np.float64)

    return run


def _jax_helpers(dtype):
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import math

    def run(z, positive, coef):
        weights = coef.positive_weights if positive else coef.negative_weights
        z = jnp.asarray(z, dtype)
        e = math.exp_neg_abs(z)
        loss, slope = math.terms(z, *weights, e=e), math.slopes(z, *weights, e=e)
        return np.asarray(loss, np.float64), np.asarray(slope, np.float64)

    return run


HELPERS = {
    "torch": (_torch_helpers, ("float32", "float64")),
    "tensorflow": (_tensorflow_helpers, ("float32",)),
    "jax": (_jax_helpers, ("float32",)),
}
"""Per backend: `(factory, dtypes)`; `factory(dtype)(z, positive, coef) -> (loss, slope)`."""

CASES = [
    (backend, dtype, a, p, positive)
    for backend, (_, dtypes) in HELPERS.items()
    for dtype in dtypes
    for a, p in spec.SETTINGS
    for positive in (False, True)
]


@pytest.mark.parametrize("backend,dtype,label_smoothing,pos_weight,positive", CASES)
def test_helpers_match_the_spec_table(backend, dtype, label_smoothing, pos_weight, positive):
    if backend != BACKEND:
        pytest.skip(f"{backend} helpers run under KERAS_BACKEND={backend}")
    factory, _ = HELPERS[backend]
    rows = [
        r for r in spec.table()
        if (r.label_smoothing, r.pos_weight, r.positive) == (label_smoothing, pos_weight, positive)
    ]
    z = np.array([r.logit for r in rows])
    want_loss = np.array([r.loss for r in rows])
    want_slope = np.array([r.slope for r in rows])
    got_loss, got_slope = factory(dtype)(z.astype(dtype), positive,
                                         bce_coefficients(label_smoothing, pos_weight))
    for what, got, want in (("loss", got_loss, want_loss), ("slope", got_slope, want_slope)):
        np.testing.assert_allclose(
            got, want, rtol=RTOL[dtype], atol=ATOL[dtype],
            err_msg=f"{backend} {dtype} {what} at logits {z.tolist()}",
        )


@pytest.mark.parametrize("backend", sorted(HELPERS))
def test_a_masked_logit_adds_exactly_nothing(backend):
    """`-inf` (how the tiles skip a positive): a negative's term and slope are exactly 0."""
    if backend != BACKEND:
        pytest.skip(f"{backend} helpers run under KERAS_BACKEND={backend}")
    loss, slope = HELPERS[backend][0]("float32")(
        np.array([-np.inf], "float32"), False, bce_coefficients(0.0, 3.0)
    )
    assert loss.tolist() == [0.0] and slope.tolist() == [0.0]


@pytest.mark.parametrize("label_smoothing,pos_weight", spec.SETTINGS)
def test_kernel_coefficients_are_the_spec_weights(label_smoothing, pos_weight):
    coef = bce_coefficients(label_smoothing, pos_weight)
    for positive, weights in ((False, coef.negative_weights), (True, coef.positive_weights)):
        np.testing.assert_allclose(
            weights, spec.term_weights(positive, label_smoothing, pos_weight), rtol=1e-15
        )


def test_spec_table_is_the_contract_formula():
    """Checks the table against the contract's `(1 + (p - 1) y') softplus(z) - p y' z`, and its slope."""
    for r in spec.table():
        if not np.isfinite(r.logit):
            continue
        y = (1.0 - r.label_smoothing / 2.0) if r.positive else r.label_smoothing / 2.0
        p = r.pos_weight
        softplus = np.logaddexp(0.0, r.logit)
        with np.errstate(over="ignore"):
            sigmoid = 1.0 / (1.0 + np.exp(-r.logit))
        want_loss = (1.0 + (p - 1.0) * y) * softplus - p * y * r.logit
        want_slope = (1.0 + (p - 1.0) * y) * sigmoid - p * y
        np.testing.assert_allclose(r.loss, want_loss, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(r.slope, want_slope, rtol=1e-12, atol=1e-15)
