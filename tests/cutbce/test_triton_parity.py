"""The fused Triton kernels (`implementation="triton"`) against the dense reference and Keras BCE.

Runs where the kernels run: on a CUDA GPU, or on CPU tensors in the Triton
interpreter, which needs `TRITON_INTERPRET=1` before Triton is imported, so
the suite runs this module in a child process
(`tests/cutbce/test_triton_interpreter.py`); in the suite's own process it
skips, saying so. Torch backend only.

Checked per case (odd M, D and V that leave partial row blocks, vocabulary
tiles and splits; bias or none; label smoothing; pos_weight; padding,
repeated and >= 2^31 ids; rows without targets): the per-row loss and the
gradients of hidden, table and bias under a random cotangent, and the fused
weighted sum (`cut_bce_weighted_sum`) with an upstream cotangent != 1,
against `keras_cutbce.math.reference` and, at `pos_weight = 1`, against
`keras.losses.binary_crossentropy` on the dense logits.

Interpreter dtypes: float32, and bf16 inputs with the kernels' products on
operands cast to fp32 (`INTERPRET`), because bf16 `tl.dot` gives wrong
results in the interpreter (triton#11584, unsupported upstream); the bf16
hi/lo split of the gradient products is checked there on its fp32 result.
"""

import functools
import importlib.util

import keras
import numpy as np
import pytest

from tests.cutbce.torch_inputs import (
    UPSTREAM,
    as_numpy,
    ids_of_kind,
    row_weights,
    scaled_value_and_grads,
    tensors,
)


def _runs_here():
    if keras.backend.backend() != "torch":
        return False, "Triton kernels: torch backend only"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install '.[triton-compile]')"
    import torch

    from keras_cutbce.backends.torch.triton.launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        return False, ("no CUDA device and TRITON_INTERPRET is not set: "
                       "tests/cutbce/test_triton_interpreter.py runs this module in the interpreter")
    return True, ""


_RUNS, _WHY = _runs_here()
pytestmark = pytest.mark.skipif(not _RUNS, reason=_WHY)


def triton_runs_here():
    """Returns True where the Triton kernels run (a GPU, or the interpreter's child process)."""
    return _RUNS

CASES = {
    # name: (M, D, V, ids kind, bias, label_smoothing, pos_weight, dtype)
    "odd_shapes_bias": (37, 7, 101, "mixed", True, 0.0, 1.0, "float32"),
    "duplicates_no_bias": (21, 5, 67, "dups", False, 0.0, 1.0, "float32"),
    "no_targets": (19, 3, 45, "empty", True, 0.0, 1.0, "float32"),
    "single_target_wide_d": (18, 33, 70, "single", True, 0.0, 1.0, "float32"),
    "label_smoothing": (23, 9, 83, "mixed", True, 0.2, 1.0, "float32"),
    "smoothing_and_pos_weight": (17, 6, 59, "dups", False, 0.1, 3.5, "float32"),
    "bfloat16": (29, 12, 77, "mixed", True, 0.05, 2.0, "bfloat16"),
    "float16": (26, 10, 61, "dups", True, 0.0, 1.0, "float16"),
}
# Half-precision gradients come back in their dtype (one rounding: 2^-9 relative for bf16).
TOLERANCES = {"float32": (1e-5, 1e-6), "bfloat16": (2e-2, 1e-2), "float16": (4e-3, 2e-3)}


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _problem(name, rng):
    import torch

    m, d, v, kind, with_bias, a, p, dtype = CASES[name]
    h, e, b = (None if x is None else x.to(_device())
               for x in tensors(rng, m, d, v, with_bias, dtype))
    ids = ids_of_kind(kind, m, v, rng)
    if kind == "mixed":
        ids[3, 1] = 2**40  # an id >= 2^31: padding
    return h, e, b, torch.tensor(ids, device=_device()), (a, p, dtype)


def _assert_grads_close(got, want, dtype):
    rtol, atol = TOLERANCES[dtype]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            scale = max(1.0, float(np.abs(as_numpy(w)).max())) if dtype != "float32" else 1.0
            np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=rtol, atol=atol * scale)


def _reference_objective(ids, a, p, cotangent):
    from keras_cutbce.math import reference

    return lambda h, e, b: (cotangent * reference.cut_bce(
        h, e, ids, b, label_smoothing=a, pos_weight=p)).sum()


def _keras_objective(ids, a, v, cotangent):
    from keras_cutbce.math import reference

    def objective(h, e, b):
        z = reference.logits(h, e, b)
        y = reference.multi_hot(ids, v)
        return (cotangent * keras.losses.binary_crossentropy(
            y, z, from_logits=True, label_smoothing=a)).sum()

    return objective


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_row_loss_and_gradients_under_any_cotangent(name, rng):
    import torch

    from keras_cutbce.backends.torch.triton import launch as kernels

    h, e, b, ids, (a, p, dtype) = _problem(name, rng)
    cotangent = torch.tensor(rng.normal(size=h.shape[0]), dtype=torch.float32, device=h.device)

    def triton_objective(h, e, b):
        loss = kernels.cut_bce(h, e, ids, b, label_smoothing=a, pos_weight=p)
        assert loss.dtype == torch.float32 and loss.shape == (h.shape[0],)
        return (cotangent * loss).sum()

    got = scaled_value_and_grads(triton_objective, (h, e, b))
    want = scaled_value_and_grads(_reference_objective(ids, a, p, cotangent), (h, e, b))
    _assert_grads_close([got[0]] + got[1], [want[0]] + want[1], dtype)
    for grad, x in zip(got[1], (h, e, b)):
        assert grad is None or (grad.dtype == x.dtype and grad.shape == x.shape)
    if p == 1.0:
        keras_bce = scaled_value_and_grads(_keras_objective(ids, a, e.shape[0], cotangent), (h, e, b))
        _assert_grads_close([got[0]] + got[1], [keras_bce[0]] + keras_bce[1], dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_weighted_sum(name, rng):
    from keras_cutbce.backends.torch.triton import launch as kernels

    h, e, b, ids, (a, p, dtype) = _problem(name, rng)
    w = row_weights(rng, h.shape[0]).to(h.device)
    value, grads = scaled_value_and_grads(
        lambda h, e, b: kernels.cut_bce_weighted_sum(h, e, ids, b, w, label_smoothing=a,
                                                     pos_weight=p),
        (h, e, b),
    )
    want_value, want_grads = scaled_value_and_grads(_reference_objective(ids, a, p, w), (h, e, b))
    _assert_grads_close([value] + grads, [want_value] + want_grads, dtype)
    assert (grads[0][w == 0] == 0).all()  # masked rows get no hidden gradient
    assert UPSTREAM != 1.0


def test_public_op_routes_triton(rng):
    """`implementation="triton"` through the public op and `CutBCELoss` (the fused path)."""
    import torch

    from keras_cutbce import CutBCELoss
    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce.math import reference

    h, e, b, ids, _ = _problem("odd_shapes_bias", rng)
    got = cut_binary_crossentropy(h, e, ids, b, implementation="triton")
    want = reference.cut_bce(h, e, ids, b)
    np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-6)
    table = keras.Variable(as_numpy(e).astype("float32"))
    loss = CutBCELoss(table, implementation="triton")(ids, h)
    want = reference.cut_bce(h, e, ids).mean()
    assert isinstance(loss, torch.Tensor)
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)


def test_bf16_split_products_keep_fp32_accuracy(rng):
    """The gradient products of bf16 inputs: the hi/lo split gives ~1e-5, one rounding ~3e-3."""
    import torch

    from keras_cutbce.backends.torch import chunked as kernel, math
    from keras_cutbce.backends.torch.chunked import Positives
    from keras_cutbce.backends.torch.triton import launch
    from keras_cutbce.math.coefficients import bce_coefficients
    from keras_cutbce.math.tiling import vocab_tiles

    m, d, v = 33, 16, 90
    h, e, _ = tensors(rng, m, d, v, False, "bfloat16")
    h, e = h.to(_device()).float(), e.to(_device()).float()  # bf16 values, exact in fp32
    ids = torch.tensor(ids_of_kind("mixed", m, v, rng), device=h.device)
    tiles = vocab_tiles(v, v)
    positives = Positives(ids, tiles)
    scale = torch.rand(m, device=h.device) + 0.5
    need = (True, True, True)
    family = math.BCE(bce_coefficients())
    got = launch.dense_pass(h, e, None, tiles, positives, loss=True, row_scale=scale, need=need,
                            family=family, operands=torch.bfloat16)
    want = kernel.dense_pass(h, e, None, tiles, positives, loss=True, row_scale=scale, need=need,
                             family=family)
    for g, w in zip(got, want):
        np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=5e-5, atol=5e-5 * float(w.abs().max()))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_every_policy_is_as_exact_as_the_dense_model_under_it(policy, rng):
    """The mixed precision matrix of the kernels (as `tests/cutbce/test_cut_bce.py`'s).

    Hidden states in the policy's compute dtype (the kernels' operand dtype),
    the float32 table and bias; the per-row loss under a loss-scaled cotangent
    and the fused weighted sum scaled after it; against float64, each row no
    worse than twice the dense Keras model under the policy.
    """
    import torch

    from keras_cutbce.backends.torch.triton import launch as kernels
    from tests.backend_utils import assert_within_low_precision, dtype_policy, loss_scale
    from tests.cutbce.kernel_inputs import dense_under_policy, policy_inputs
    from tests.cutbce.test_chunked import truth

    h, e, b, ids, w = policy_inputs(rng, rows=37, dim=12, vocab=101)
    w = w / len(w)  # a mean over the rows, as `CutBCELoss`'s
    scale = loss_scale(policy)
    with dtype_policy(policy) as compute:
        hidden = torch.tensor(h, device=_device()).to(getattr(torch, compute))
        table, bias = (torch.tensor(x, device=_device()) for x in (e, b))
        ids_t, weights = torch.tensor(ids, device=_device()), torch.tensor(w, device=_device())
        exact = as_numpy(hidden)
        dense = dense_under_policy(compute)
        cases = (
            ("per-row", lambda h, e, b: (kernels.cut_bce(h, e, ids_t, b) * weights * scale).sum(),
             lambda h, e, b: (dense(h, e, ids_t, b) * weights * scale).sum(), w * scale),
            ("fused", lambda h, e, b: kernels.cut_bce_weighted_sum(
                h, e, ids_t, b, weights, label_smoothing=0.0, pos_weight=1.0) * scale,
             lambda h, e, b: (dense(h, e, ids_t, b) * weights).sum() * scale, w * scale),
        )
        for name, ours, theirs, rows in cases:
            got = scaled_value_and_grads(ours, (hidden, table, bias))
            low = scaled_value_and_grads(theirs, (hidden, table, bias))
            want_losses, want_grads = truth(exact, e, ids, b, rows)
            # `scaled_value_and_grads`: the value, and the gradients of UPSTREAM times it
            want = [np.sum(rows * want_losses)] + [UPSTREAM * g for g in want_grads]
            for what, g, lo, wa in zip(("value", "d hidden", "d table", "d bias"),
                                       [got[0]] + got[1], [low[0]] + low[1], want):
                assert_within_low_precision(as_numpy(g), as_numpy(lo), wa, f"{policy} {name} {what}")


def test_float16_table_gradient_under_a_loss_scale(rng):
    """fp16 inputs, the fused weighted sum (the loss scale multiplies after its pass), a
    trained model's negatives (bias -12): the table gradient of the items no row targets is
    as exact as the chunked loop's (both end in an fp16 gradient), never flushed to zero
    (a slope `sigmoid(-12) / (M V)` is below fp16's smallest subnormal, 6e-8)."""
    import torch

    from keras_cutbce.backends.torch import chunked
    from keras_cutbce.backends.torch.triton import launch as kernels
    from tests.backend_utils import LOSS_SCALE, worst_row_error
    from tests.cutbce.test_chunked import truth

    m, d, v = 64, 16, 512
    h = (rng.normal(size=(m, d)) * 0.5).astype("float16")
    e = (rng.normal(size=(v, d)) * 0.5).astype("float16")
    b = np.full(v, -12.0, "float32")
    ids = rng.integers(0, v // 4, size=(m, 4))
    never = np.setdiff1d(np.arange(v), ids)
    w = np.full(m, 1.0 / m, "float32")
    want = truth(h, e, ids, b, w * LOSS_SCALE)[1][1][never]
    got = {}
    for name, fn in (("triton", kernels.cut_bce_weighted_sum),
                     ("chunked", functools.partial(chunked.cut_bce_weighted_sum, chunk_size=128))):
        args = [torch.tensor(x, device=_device()).requires_grad_(True) for x in (h, e, b)]
        total = fn(args[0], args[1], torch.tensor(ids, device=_device()), args[2],
                   torch.tensor(w, device=_device()), label_smoothing=0.0, pos_weight=1.0)
        (total * LOSS_SCALE).backward()
        got[name] = as_numpy(args[1].grad)[never]
    zeros = {name: float(np.mean(g == 0.0)) for name, g in got.items()}
    errors = {name: worst_row_error(g, want) for name, g in got.items()}
    assert zeros["triton"] <= zeros["chunked"], zeros
    assert errors["triton"] <= 2.0 * errors["chunked"], errors
