"""The fused Triton kernels (`implementation="triton"`) against the dense reference, Keras BCE and float64.

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
`keras.losses.binary_crossentropy` on the dense logits. The softmax family
(`SOFTMAX_CASES`, the same tests parametrised; logits x40 among them)
against float64 (`math.spec.softmax_row`), each loss and gradient as close
as the dense float32 reference or the chunked loop is (x4), and the spec
rows through the identity table.

Interpreter dtypes: float32, and bf16 inputs with the kernels' products on
operands cast to fp32 (`INTERPRET`), because bf16 `tl.dot` gives wrong
results in the interpreter (triton#11584, unsupported upstream); the bf16
hi/lo split of the gradient products is checked there on its fp32 result.
"""

import contextlib
import functools
import importlib.util

import keras
import numpy as np
import pytest

from keras_cutbce.math import spec
from tests.backend_utils import worst_row_error

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
    "sparse_tiles": (40, 8, 700, "single", True, 0.0, 1.0, "float32"),  # most tiles hold no positive
}
SOFTMAX_CASES = {
    # name: (M, D, V, ids kind, bias, label_smoothing, logit scale, dtype)
    "odd_shapes_bias": (37, 7, 101, "mixed", True, 0.0, 1.0, "float32"),
    "duplicates_no_bias": (21, 5, 67, "dups", False, 0.1, 1.0, "float32"),
    "single_target_wide_d": (18, 33, 70, "single", True, 0.0, 1.0, "float32"),
    "saturated_x40": (23, 9, 83, "mixed", True, 0.1, 40.0, "float32"),
    "bfloat16": (29, 12, 77, "mixed", True, 0.1, 1.0, "bfloat16"),
    "float16": (26, 10, 61, "dups", True, 0.0, 1.0, "float16"),
}
FAMILY_CASES = [("bce", n) for n in sorted(CASES)] + [("softmax", n) for n in sorted(SOFTMAX_CASES)]
# Half-precision gradients come back in their dtype (one rounding: 2^-9 relative for bf16).
TOLERANCES = {"float32": (1e-5, 1e-6), "bfloat16": (2e-2, 1e-2), "float16": (4e-3, 2e-3)}


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _problem(name, rng, family="bce"):
    import torch

    if family == "softmax":
        m, d, v, kind, with_bias, a, scale, dtype = SOFTMAX_CASES[name]
        p = None
    else:
        (m, d, v, kind, with_bias, a, p, dtype), scale = CASES[name], 1.0
    h, e, b = (None if x is None else x.to(_device())
               for x in tensors(rng, m, d, v, with_bias, dtype))
    h = (h.float() * scale).to(h.dtype)
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


def _op(family, weighted=False):
    """The kernels' entry point of `family` and its options `(a, p) -> kwargs`."""
    from keras_cutbce.backends.torch.triton import launch

    name = ("cut_bce" if family == "bce" else "cut_softmax") + ("_weighted_sum" if weighted else "")
    if family == "bce":
        return getattr(launch, name), lambda a, p: dict(label_smoothing=a, pos_weight=p)
    return getattr(launch, name), lambda a, p: dict(label_smoothing=a)


def _softmax_float64(h, e, b, ids, a, weights):
    """The float64 loss `[M]` and the gradients of `UPSTREAM * sum(weights * loss)` (`spec.softmax_row`)."""
    h, e = as_numpy(h), as_numpy(e)
    z = h @ e.T + (0.0 if b is None else as_numpy(b))
    ids = np.asarray(ids.cpu())
    rows = [spec.softmax_row(z[m], [i for i in ids[m] if 0 <= i < len(e)], a) for m in range(len(z))]
    loss = np.array([r[0] for r in rows])
    s = UPSTREAM * np.stack([r[1] for r in rows]) * as_numpy(weights)[:, None]
    return loss, [s @ e, s.T @ h] + ([] if b is None else [s.sum(0)])


def _assert_softmax_close(got, objective, problem, weights, dtype):
    """`got` (value and gradients of `objective`) as close to float64 as the dense or chunked loop, x4.

    The floor: the half dtypes' tolerance (their gradients come back rounded), 1e-6 in float32.
    """
    from keras_cutbce.backends.torch import chunked
    from keras_cutbce.math import reference

    h, e, b, ids, (a, _, _) = problem
    loss, grads = _softmax_float64(h, e, b, ids, a, weights)
    want = [np.sum(as_numpy(weights) * loss)] + grads
    others = [
        scaled_value_and_grads(objective(functools.partial(reference.cut_softmax, label_smoothing=a)),
                               (h, e, b)),
        scaled_value_and_grads(objective(functools.partial(chunked.cut_softmax, label_smoothing=a,
                                                           chunk_size=16)), (h, e, b)),
    ]
    floor = 1e-6 if dtype == "float32" else TOLERANCES[dtype][0]
    for i, what in enumerate(("value", "d hidden", "d table", "d bias")[:len(want)]):
        def error(result):
            value = result[0] if i == 0 else result[1][i - 1]
            return worst_row_error(np.reshape(as_numpy(value), np.shape(want[i]) or (1,)),
                                   np.reshape(want[i], np.shape(want[i]) or (1,)))

        bound = max([floor] + [4.0 * error(other) for other in others])
        assert error(got) <= bound, (what, error(got), [error(o) for o in others])


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


# Also run under torch's "high" matmul precision: the TF32 kernels (the gradient products' k reordered,
# the columns kernel items first). The interpreter's products stay fp32, so the tolerances are float32's;
# on a GPU TF32 rounds the operands (the GPU check's TF32 parity covers it there).
TF32_CASES = [("bce", "odd_shapes_bias"), ("bce", "sparse_tiles"), ("softmax", "saturated_x40")]


@contextlib.contextmanager
def _matmul_precision(precision):
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("family, name, precision", [(f, n, "highest") for f, n in FAMILY_CASES]
                         + [(f, n, "high") for f, n in TF32_CASES])
def test_per_row_loss_and_gradients_under_any_cotangent(family, name, precision, rng):
    import torch

    from keras_cutbce.backends.torch.triton.launch import interpreting

    if precision == "high" and not interpreting():
        pytest.skip("TF32 on a GPU rounds the operands: the GPU check's TF32 parity covers it")
    problem = _problem(name, rng, family)
    h, e, b, ids, (a, p, dtype) = problem
    cotangent = torch.tensor(rng.normal(size=h.shape[0]), dtype=torch.float32, device=h.device)
    op, options = _op(family)
    losses = []

    def triton_objective(h, e, b):
        loss = op(h, e, ids, b, **options(a, p))
        assert loss.dtype == torch.float32 and loss.shape == (h.shape[0],)
        losses.append(loss.detach())
        return (cotangent * loss).sum()

    with _matmul_precision(precision):
        got = scaled_value_and_grads(triton_objective, (h, e, b))
    for grad, x in zip(got[1], (h, e, b)):
        assert grad is None or (grad.dtype == x.dtype and grad.shape == x.shape)
    if family == "softmax":
        def objective(fn):
            return lambda h, e, b: (cotangent * fn(h, e, ids, b)).sum()

        _assert_softmax_close(got, objective, problem, cotangent, dtype)
        from keras_cutbce.backends.torch import chunked
        from keras_cutbce.math import reference

        want_loss, _ = _softmax_float64(h, e, b, ids, a, cotangent)
        dense, loop = (as_numpy(f(h, e, ids, b, label_smoothing=a)) for f in (
            reference.cut_softmax, functools.partial(chunked.cut_softmax, chunk_size=16)))
        error = np.abs(as_numpy(losses[0]) - want_loss).max()
        bound = max(4 * np.abs(dense - want_loss).max(), 4 * np.abs(loop - want_loss).max(), 1e-6)
        assert error <= bound, (error, bound)
        empty = ~((ids >= 0) & (ids < e.shape[0])).any(1)  # no valid id: loss 0, no gradient
        assert (losses[0][empty] == 0).all() and (got[1][0][empty] == 0).all()
        return
    want = scaled_value_and_grads(_reference_objective(ids, a, p, cotangent), (h, e, b))
    _assert_grads_close([got[0]] + got[1], [want[0]] + want[1], dtype)
    if p == 1.0:
        keras_bce = scaled_value_and_grads(_keras_objective(ids, a, e.shape[0], cotangent), (h, e, b))
        _assert_grads_close([got[0]] + got[1], [keras_bce[0]] + keras_bce[1], dtype)


@pytest.mark.parametrize("family, name", FAMILY_CASES)
def test_fused_weighted_sum(family, name, rng):
    problem = _problem(name, rng, family)
    h, e, b, ids, (a, p, dtype) = problem
    w = row_weights(rng, h.shape[0]).to(h.device)
    op, options = _op(family, weighted=True)
    value, grads = scaled_value_and_grads(lambda h, e, b: op(h, e, ids, b, w, **options(a, p)),
                                          (h, e, b))
    if family == "softmax":
        _assert_softmax_close((value, grads), lambda fn: lambda h, e, b: (w * fn(h, e, ids, b)).sum(),
                              problem, w, dtype)
    else:
        want_value, want_grads = scaled_value_and_grads(_reference_objective(ids, a, p, w), (h, e, b))
        _assert_grads_close([value] + grads, [want_value] + want_grads, dtype)
    assert (grads[0][w == 0] == 0).all()  # masked rows get no hidden gradient
    assert UPSTREAM != 1.0


@pytest.mark.parametrize("family", ["bce", "softmax"])
def test_public_op_routes_triton(family, rng):
    """`implementation="triton"` through the public op and its Keras loss (the fused path)."""
    import torch

    import keras_cutbce
    from keras_cutbce.math import reference

    op, loss_class, dense = {
        "bce": (keras_cutbce.cut_binary_crossentropy, keras_cutbce.CutBCELoss, reference.cut_bce),
        "softmax": (keras_cutbce.cut_categorical_crossentropy, keras_cutbce.CutSoftmaxLoss,
                    reference.cut_softmax),
    }[family]
    h, e, b, ids, _ = _problem("odd_shapes_bias", rng)
    got = op(h, e, ids, b, implementation="triton")
    want = dense(h, e, ids, b)
    np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-6)
    table = keras.Variable(as_numpy(e).astype("float32"))
    loss = loss_class(table, implementation="triton")(ids, h)
    want = dense(h, e, ids).mean()
    assert isinstance(loss, torch.Tensor)
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.skipif(not _RUNS or _device() != "cuda", reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("family", ["bce", "softmax"])
def test_auto_runs_the_kernels_on_a_gpu_and_torchs_deterministic_mode_keeps_the_bits(family, rng,
                                                                                     monkeypatch):
    """On CUDA tensors of a tested capability `"auto"` launches the Triton kernels (not the chunked
    loop), and under `torch.use_deterministic_algorithms(True)` a training step runs (no op refuses
    it) to the same bits as without it. With torch's condition for cuBLAS in that mode (softmax merges
    its splits' hidden gradients with an `einsum`)."""
    import torch

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import keras_cutbce

    op = {"bce": keras_cutbce.cut_binary_crossentropy,
          "softmax": keras_cutbce.cut_categorical_crossentropy}[family]
    h, e, b, ids, _ = _problem("odd_shapes_bias", rng)

    def step():
        args = [x.detach().clone().requires_grad_(True) for x in (h, e, b)]
        op(args[0], args[1], ids, args[2], implementation="auto").sum().backward()
        return [x.grad for x in args]

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        grads = step()
        torch.cuda.synchronize()
    kernels = {event.key for event in profile.key_averages()}
    assert any("rows_kernel" in k for k in kernels) and any("columns_kernel" in k for k in kernels), kernels
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        again = step()
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(g, a) for g, a in zip(grads, again))


@pytest.mark.parametrize("family", ["bce", "softmax"])
def test_bf16_split_products_keep_fp32_accuracy(family, rng):
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
    stats = None
    if family == "bce":
        family = fused = math.BCE(bce_coefficients())
    else:  # the loop's two passes against the kernels' one; compared on the rows' log-sum-exp
        family = fused = math.Softmax(0.1, v)
        stats = torch.logsumexp(h @ e.T, 1)
    got = launch.dense_pass(h, e, None, tiles, positives, loss=True, row_scale=scale, need=need,
                            family=fused, operands=torch.bfloat16)
    want = kernel.dense_pass(h, e, None, tiles, positives, loss=True, row_scale=scale, need=need,
                             family=family, stats=stats)
    if stats is not None:
        got, want = (family.statistics(got[0]),) + got[1:], (stats,) + want[1:]
    for g, w in zip(got, want):
        np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=5e-5, atol=5e-5 * float(w.abs().max()))


@pytest.mark.parametrize("label_smoothing", spec.SOFTMAX_SMOOTHING)
def test_softmax_spec_rows_through_the_identity_table(label_smoothing):
    """Saturated logits (|z| up to 1e3): the loss and slopes of each float64 spec row."""
    import torch

    from keras_cutbce.backends.torch.triton import launch

    z = torch.tensor([row for row, _ in spec.SOFTMAX_ROWS], dtype=torch.float32, device=_device())
    width = max(len(t) for _, t in spec.SOFTMAX_ROWS)
    ids = torch.tensor([list(t) + [-1] * (width - len(t)) for _, t in spec.SOFTMAX_ROWS],
                       device=_device())
    eye = torch.eye(z.shape[1], device=_device())
    z.requires_grad_(True)
    loss = launch.cut_softmax(z, eye, ids, label_smoothing=label_smoothing)
    loss.sum().backward()
    loss = loss.detach()
    for row, (logits, targets) in enumerate(spec.SOFTMAX_ROWS):
        want_loss, want_slopes = spec.softmax_row(logits, targets, label_smoothing)
        # float32: the log-sum-exp carries a rounding of `max |z|`, as in any float32 softmax
        tolerance = 4 * 2.0**-24 * (np.max(np.abs(logits)) + 1.0)
        assert abs(float(loss[row]) - want_loss) <= tolerance + 4 * 2.0**-24 * abs(want_loss), row
        np.testing.assert_allclose(as_numpy(z.grad[row]), want_slopes, rtol=0, atol=tolerance)


def test_softmax_items_with_a_bias_of_minus_inf_drop_out(rng):
    """The kernels' part: items at `-inf` (a whole tile and split of them) are left out exactly."""
    import torch

    from keras_cutbce.backends.torch import math
    from keras_cutbce.backends.torch.chunked import Positives
    from keras_cutbce.backends.torch.triton import launch
    from keras_cutbce.math.tiling import vocab_tiles

    h, e, b, ids, _ = _problem("odd_shapes_bias", rng, "softmax")
    cut = 70  # the interpreter's tiles are 32 wide, 2 a split: the first split, part of the third tile
    b = b.clone()
    b[:cut] = float("-inf")
    scale = torch.rand(h.shape[0], device=h.device) + 0.5

    def run(e, b):
        tiles = vocab_tiles(e.shape[0], e.shape[0])
        family = math.Softmax(0.0, e.shape[0])
        acc, *grads = launch.dense_pass(h, e, b, tiles, Positives(ids[:, :0], tiles), loss=True,
                                        row_scale=scale, need=(True, True, True), family=family)
        return [family.statistics(acc)] + grads

    got, want = run(e, b), run(e[cut:], b[cut:])
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=1e-6, atol=1e-6)
    for g, w in zip(got[2:], want[2:]):
        assert (g[:cut] == 0).all()
        np.testing.assert_allclose(as_numpy(g[cut:]), as_numpy(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_softmax_masked_items_and_targets_match_the_chunked_loop(label_smoothing, rng):
    """The public kernel with `-inf` biases where targets and padding ids fall (the contract:
    `keras_cutbce.registry`): the chunked loop's loss (`+inf` at a masked target, or any
    smoothing) and the gradients of the finite rows."""
    import torch

    from keras_cutbce.backends.torch import chunked
    from keras_cutbce.backends.torch.triton import launch

    h, e, b, ids, _ = _problem("odd_shapes_bias", rng, "softmax")
    b = b.clone()
    b[:8], b[64:] = float("-inf"), float("-inf")  # item 0 (where padding falls) and whole tiles
    valid = (ids >= 0) & (ids < 8) | (ids >= 64) & (ids < len(e))
    ids = torch.where(valid, 50, ids)
    ids[:2, 0] = torch.tensor([0, 70])  # two masked targets
    got_loss = launch.cut_softmax(h, e, ids, b, label_smoothing=label_smoothing)
    want_loss = chunked.cut_softmax(h, e, ids, b, label_smoothing=label_smoothing, chunk_size=16)
    np.testing.assert_allclose(as_numpy(got_loss), as_numpy(want_loss), rtol=1e-5, atol=1e-5)
    assert torch.isposinf(got_loss[:2]).all() and not torch.isnan(got_loss).any()
    weights = torch.isfinite(want_loss).to(h.dtype)
    assert weights.sum() > 10 or label_smoothing

    def objective(fn):
        return lambda h, e, b: (weights * torch.nan_to_num(fn(h, e, ids, b), posinf=0.0)).sum()

    got = scaled_value_and_grads(objective(functools.partial(
        launch.cut_softmax, label_smoothing=label_smoothing)), (h, e, b))
    want = scaled_value_and_grads(objective(functools.partial(
        chunked.cut_softmax, label_smoothing=label_smoothing, chunk_size=16)), (h, e, b))
    _assert_grads_close(got[1], want[1], "float32")
    assert not any(torch.isnan(g).any() for g in got[1])


@pytest.mark.parametrize("family", ["bce", "softmax"])
@pytest.mark.parametrize("policy, table_dtype", [
    ("float32", "float32"), ("mixed_bfloat16", "float32"), ("mixed_float16", "float32"),
    ("mixed_bfloat16", "compute"), ("mixed_float16", "compute"),
])
def test_every_policy_is_as_exact_as_the_dense_model_under_it(policy, table_dtype, family, rng):
    """The mixed precision matrix of the kernels (as `tests/cutbce/test_cut_bce.py`'s), both families.

    Hidden states in the policy's compute dtype (the kernels' operand dtype),
    the float32 table (or, `"compute"`, one in the compute dtype: its gradient
    stored there, the table gradient's product unsplit as the hidden one's)
    and bias; the per-row loss under a loss-scaled cotangent and the fused
    weighted sum scaled after it; against float64, each row no worse than
    twice the dense Keras model under the policy (binary or categorical
    cross-entropy on its logits).
    """
    import torch

    from tests.backend_utils import assert_within_low_precision, dtype_policy, loss_scale
    from tests.cutbce.kernel_inputs import dense_under_policy, policy_inputs
    from tests.cutbce.test_chunked import truth

    h, e, b, ids, w = policy_inputs(rng, rows=37, dim=12, vocab=101)
    w = w / len(w)  # a mean over the rows, as `CutBCELoss`'s
    scale = loss_scale(policy)
    per_row, options = _op(family)
    weighted_sum, _ = _op(family, weighted=True)
    options = options(0.0, 1.0)
    with dtype_policy(policy) as compute:
        hidden = torch.tensor(h, device=_device()).to(getattr(torch, compute))
        table, bias = (torch.tensor(x, device=_device()) for x in (e, b))
        if table_dtype == "compute":
            table = table.to(getattr(torch, compute))
            e = as_numpy(table)
        ids_t, weights = torch.tensor(ids, device=_device()), torch.tensor(w, device=_device())
        exact = as_numpy(hidden)
        dense = dense_under_policy(compute, family)
        cases = (
            ("per-row", lambda h, e, b: (per_row(h, e, ids_t, b, **options) * weights * scale).sum(),
             lambda h, e, b: (dense(h, e, ids_t, b) * weights * scale).sum(), w * scale),
            ("fused", lambda h, e, b: weighted_sum(h, e, ids_t, b, weights, **options) * scale,
             lambda h, e, b: (dense(h, e, ids_t, b) * weights).sum() * scale, w * scale),
        )
        for name, ours, theirs, rows in cases:
            got = scaled_value_and_grads(ours, (hidden, table, bias))
            low = scaled_value_and_grads(theirs, (hidden, table, bias))
            # `scaled_value_and_grads`: the value, and the gradients of UPSTREAM times it
            if family == "bce":
                want_losses, want_grads = truth(exact, e, ids, b, rows)
                want_grads = [UPSTREAM * g for g in want_grads]
            else:
                want_losses, want_grads = _softmax_float64(hidden, table, bias, ids_t, 0.0,
                                                             torch.tensor(rows))
            want = [np.sum(rows * want_losses)] + want_grads
            for what, g, lo, wa in zip(("value", "d hidden", "d table", "d bias"),
                                       [got[0]] + got[1], [low[0]] + low[1], want):
                assert_within_low_precision(as_numpy(g), as_numpy(lo), wa,
                                            f"{family} {policy} {name} {what}")


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
