"""The Triton kernels' element-wise math on a GPU, emulated in numpy against float64.

The interpreter runs `exp2` and division exactly, so what only the GPU
computes is emulated here, float32 step by step: `ex2.approx.ftz` as `2^x`
off by its documented worst case, 2^-22 relative either way, and flushed
to 0 below 2^-126; `rcp.approx.ftz` off by 1 ulp either way; the `LOG1P`
polynomial's fused multiply-adds rounded once each. Checked: `log1p` on
[0, 1], softplus and both kernels' sigmoids over the whole float32 logit range, and the
saturated rows of `tests/cutbce/test_saturated_logits.py` at that test's
float64 tolerances. What a GPU must confirm: the hardware's `ex2`/`rcp`
errors within those bounds.
"""

import importlib.util

import keras
import numpy as np
import pytest

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # overflows to inf, as the GPU's
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


def _exp(x, sign):
    e = (np.exp2((x * np.float32(1.4426950408889634)).astype(np.float64)) * (1 + sign * EX2_ERROR))
    return np.where(e < TINY, 0.0, e).astype(np.float32)  # overflows to inf past 2^128


def _reciprocal(x, sign):
    r = (1 / x.astype(np.float64) * (1 + sign * RCP_ERROR)).astype(np.float32)
    return np.where(r < TINY, np.float32(0), r)


def _kernel_math(z, ex2_sign, rcp_sign):
    """`(softplus(z), sigmoid(z), sigmoid(z))` as the kernels compute them on a GPU, float32: the rows
    kernel's `_softplus_sigmoid` (from `exp(-|z|)`) and the columns kernel's `_sigmoid`."""
    e = _exp(-np.abs(z), ex2_sign)
    r = _reciprocal(np.float32(1) + e, rcp_sign)
    columns = _reciprocal(np.float32(1) + _exp(-z, ex2_sign), rcp_sign)
    return np.maximum(z, np.float32(0)) + _log1p(e), np.where(z >= 0, r, e * r), columns


def _relative(got, want):
    return np.abs(got.astype(np.float64) - want) / want


def test_log1p_polynomial_within_two_ulp_on_the_unit_interval():
    e = np.concatenate([np.linspace(0, 1, 500_001), np.geomspace(1e-38, 1, 50_001)]).astype(np.float32)
    want = np.log1p(e.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(_log1p(e) - want) <= 2 * ulp).all()


@pytest.mark.parametrize("ex2_sign,rcp_sign", [(-1, -1), (0, 1), (1, 1), (1, -1)])
def test_softplus_and_sigmoid_over_the_float32_range(ex2_sign, rcp_sign):
    magnitudes = np.concatenate([np.linspace(0, 120, 240_001), np.geomspace(1e-7, 3e38, 20_001)])
    z = np.concatenate([magnitudes, -magnitudes]).astype(np.float32)
    z64 = z.astype(np.float64)
    softplus, rows_sigmoid, columns_sigmoid = _kernel_math(z, ex2_sign, rcp_sign)
    want_softplus = np.logaddexp(0, z64)
    want_sigmoid = np.exp(-np.logaddexp(0, -z64))
    # `exp(-|z|)` carries the rounding of its float32 argument `-|z| log2(e)` (as `tl.exp` did
    # before: up to about 2^-24 |z| relative), then ex2's, rcp's and the polynomial's own errors.
    argument = (-np.abs(z) * np.float32(1.4426950408889634)).astype(np.float64)
    bound = np.log(2) * np.abs(argument + np.abs(z64) / np.log(2)) + 3 * EX2_ERROR
    normal = want_softplus > TINY
    assert (_relative(softplus, want_softplus)[normal] <= bound[normal]).all()
    normal = want_sigmoid > TINY
    for sigmoid in rows_sigmoid, columns_sigmoid:
        assert (_relative(sigmoid, want_sigmoid)[normal] <= bound[normal]).all()
        assert (np.abs(sigmoid - want_sigmoid)[~normal] <= TINY).all()
        assert (sigmoid[z <= -104] == 0).all()
    assert (softplus[z <= -104] == 0).all()


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
    softplus, *sigmoids = _kernel_math(np.where(positive, -np.inf, z).astype(np.float32), ex2_sign,
                                       rcp_sign)
    z64 = z.astype(np.float64)
    terms = softplus + np.where(positive, np.logaddexp(0, -z64), 0.0)
    loss = terms.astype(np.float64).mean(axis=1)
    assert (np.abs(loss - want_loss) <= 2e-6 * np.abs(want_loss) + 1.2e-38).all()
    for sigmoid in sigmoids:
        slopes = sigmoid - np.where(positive, np.exp(-np.logaddexp(0, z64)), 0.0)
        dz = cotangent.astype(np.float64)[:, None] * slopes / z.shape[1]
        assert (np.abs(dz - want_dz) <= 1e-5 * np.abs(want_dz) + 1.2e-38).all()
