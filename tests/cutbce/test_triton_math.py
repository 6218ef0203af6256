"""The Triton kernels' element-wise math on a GPU, emulated in numpy against float64.

The interpreter runs `exp2` and division exactly, so what only the GPU
computes is emulated here, float32 step by step: `ex2.approx.ftz` as `2^x`
off by its documented worst case, 2^-22 relative either way, and flushed
to 0 below 2^-126; `rcp.approx.ftz` off by 1 ulp either way; the `LOG1P`
polynomial's fused multiply-adds rounded once each. Checked: `log1p` on
[0, 1], softplus and sigmoid over the whole float32 logit range, and the
saturated rows of `tests/cutbce/test_saturated_logits.py` at that test's
float64 tolerances. What a GPU must confirm: the hardware's `ex2`/`rcp`
errors within those bounds.
"""

import importlib.util

import keras
import numpy as np
import pytest

pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="Triton kernels: torch only"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (pip install '.[triton-compile]')"),
]

EX2_ERROR, RCP_ERROR = 2.0**-22, 2.0**-23
TINY = 2.0**-126


def _fma(a, b, c):
    return (a.astype(np.float64) * b + c).astype(np.float32)  # a float32 product is exact in float64


def _log1p(e):
    from keras_cutbce.backends.torch.triton.kernels import LOG1P

    coefficients = [np.float32(c) for c in LOG1P.value]
    p = np.full_like(e, coefficients[-1])
    for c in coefficients[-2::-1]:
        p = _fma(p, e, c)
    return e * p


def _kernel_math(z, ex2_sign, rcp_sign):
    """`(softplus(z), sigmoid(z))` as `_softplus_sigmoid` computes them on a GPU, float32."""
    x = -np.abs(z) * np.float32(1.4426950408889634)
    e = (np.exp2(x.astype(np.float64)) * (1 + ex2_sign * EX2_ERROR)).astype(np.float32)
    e = np.where(e < TINY, np.float32(0), e)
    r = (1 / (np.float32(1) + e).astype(np.float64) * (1 + rcp_sign * RCP_ERROR)).astype(np.float32)
    return np.maximum(z, np.float32(0)) + _log1p(e), np.where(z >= 0, r, e * r)


def _relative(got, want):
    return np.abs(got.astype(np.float64) - want) / want


def test_log1p_polynomial_within_two_ulp_on_the_unit_interval():
    e = np.concatenate([np.linspace(0, 1, 1_000_001), np.geomspace(1e-38, 1, 100_001)]).astype(np.float32)
    want = np.log1p(e.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(_log1p(e) - want) <= 2 * ulp).all()


@pytest.mark.parametrize("ex2_sign,rcp_sign", [(-1, -1), (0, 1), (1, 1), (1, -1)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # |z| log2(e) overflows to inf: 2^-inf = 0
def test_softplus_and_sigmoid_over_the_float32_range(ex2_sign, rcp_sign):
    magnitudes = np.concatenate([np.linspace(0, 120, 600_001), np.geomspace(1e-7, 3e38, 20_001)])
    z = np.concatenate([magnitudes, -magnitudes]).astype(np.float32)
    z64 = z.astype(np.float64)
    softplus, sigmoid = _kernel_math(z, ex2_sign, rcp_sign)
    want_softplus = np.logaddexp(0, z64)
    want_sigmoid = np.exp(-np.logaddexp(0, -z64))
    # `exp(-|z|)` carries the rounding of its float32 argument `-|z| log2(e)` (as `tl.exp` did
    # before: up to about 2^-24 |z| relative), then ex2's, rcp's and the polynomial's own errors.
    argument = (-np.abs(z) * np.float32(1.4426950408889634)).astype(np.float64)
    bound = np.log(2) * np.abs(argument + np.abs(z64) / np.log(2)) + 3 * EX2_ERROR
    normal = want_softplus > TINY
    assert (_relative(softplus, want_softplus)[normal] <= bound[normal]).all()
    normal = want_sigmoid > TINY
    assert (_relative(sigmoid, want_sigmoid)[normal] <= bound[normal]).all()
    assert (np.abs(sigmoid - want_sigmoid)[~normal] <= TINY).all()
    assert (softplus[z <= -104] == 0).all() and (sigmoid[z <= -104] == 0).all()


@pytest.mark.parametrize("ex2_sign,rcp_sign", [(-1, -1), (1, 1)])
def test_saturated_rows_at_the_float64_tests_tolerances(ex2_sign, rcp_sign):
    """`test_saturated_logits.py`'s problem, a = 0, p = 1: the rows' losses to 2e-6, slopes to 1e-5."""
    from tests.cutbce.test_saturated_logits import _float64_oracle
    from tests.cutbce.test_saturated_logits import _problem

    z, _, _, ids, cotangent = _problem()
    want_loss, want_dz, _, _ = _float64_oracle(z, ids, cotangent, 0.0, 1.0)
    positive = np.zeros(z.shape, bool)
    for m, row in enumerate(ids):
        positive[m, row[(row >= 0) & (row < z.shape[1])]] = True
    # The kernels' parts: negatives' softplus(z) and sigmoid(z) (positives masked to -inf, their
    # terms added outside in float32 by torch: softplus(-z) and -sigmoid(-z)).
    softplus, sigmoid = _kernel_math(np.where(positive, -np.inf, z).astype(np.float32), ex2_sign,
                                     rcp_sign)
    z64 = z.astype(np.float64)
    terms = softplus + np.where(positive, np.logaddexp(0, -z64), 0.0)
    slopes = sigmoid - np.where(positive, np.exp(-np.logaddexp(0, z64)), 0.0)
    loss = terms.astype(np.float64).mean(axis=1)
    dz = cotangent.astype(np.float64)[:, None] * slopes / z.shape[1]
    assert (np.abs(loss - want_loss) <= 2e-6 * np.abs(want_loss) + 1.2e-38).all()
    assert (np.abs(dz - want_dz) <= 1e-5 * np.abs(want_dz) + 1.2e-38).all()
