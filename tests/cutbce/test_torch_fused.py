"""The fused torch training path `cut_bce_weighted_sum` (loss and gradients in one pass).

Checked against the dense reference, Keras BCE and the per-row `cut_bce`
with the row weights as cotangent. Runs only under KERAS_BACKEND=torch;
torch is imported inside the tests.
"""

import keras
import numpy as np
import pytest

from tests.backend_utils import TorchOpRecorder
from tests.cutbce.torch_inputs import (
    UPSTREAM,
    as_numpy,
    chunked,
    ids_of_kind,
    row_weights,
    scaled_value_and_grads,
    tensors,
)

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch fused kernel: torch backend only"
)


def _fused(ids, w, a=0.0, p=1.0, chunk=8):
    return lambda h, e, b: chunked().cut_bce_weighted_sum(
        h, e, ids, b, w, label_smoothing=a, pos_weight=p, chunk_size=chunk
    )


CASES = {
    # name: (M, D, V, chunk, ids kind, bias, label_smoothing, pos_weight)
    "v_not_multiple_of_tile": (9, 6, 37, 8, "mixed", True, 0.0, 1.0),
    "v_smaller_than_tile": (5, 4, 10, 64, "mixed", False, 0.0, 1.0),
    "single_label": (7, 5, 23, 5, "single", True, 0.0, 1.0),
    "no_labels": (6, 5, 19, 4, "empty", True, 0.0, 1.0),
    "duplicates_and_padding": (8, 3, 29, 7, "dups", False, 0.0, 1.0),
    "label_smoothing": (6, 5, 31, 6, "mixed", True, 0.2, 1.0),
    "pos_weight": (6, 5, 31, 6, "mixed", True, 0.0, 3.5),
    "smoothing_and_pos_weight": (6, 5, 33, 10, "dups", False, 0.1, 0.3),
    "tile_of_one": (4, 3, 6, 1, "mixed", True, 0.05, 2.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_keras_and_cut_bce(name, rng):
    import torch

    from keras_cutbce.math import reference

    m, d, v, chunk, kind, with_bias, a, p = CASES[name]
    h, e, b = tensors(rng, m, d, v, with_bias)
    ids = torch.tensor(ids_of_kind(kind, m, v, rng))
    w = row_weights(rng, m)
    kernels = chunked()

    value, grads = scaled_value_and_grads(_fused(ids, w, a, p, chunk), (h, e, b))
    assert value.dtype == torch.float32 and value.shape == ()
    for got, x in zip(grads, (h, e, b)):
        assert (got is None) == (x is None)
        if got is not None:
            assert got.dtype == x.dtype and got.shape == x.shape
    grads = [g for g in grads if g is not None]

    def check(want_value, want_grads):
        np.testing.assert_allclose(as_numpy(value), as_numpy(want_value), rtol=1e-5, atol=1e-6)
        want_grads = [g for g in want_grads if g is not None]
        assert len(grads) == len(want_grads) == (3 if with_bias else 2)
        for got, want in zip(grads, want_grads):
            np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-6)

    # The dense reference, reduced with the row weights.
    check(*scaled_value_and_grads(
        lambda h, e, b: (w * reference.cut_bce(h, e, ids, b, label_smoothing=a, pos_weight=p)).sum(),
        (h, e, b),
    ))
    # The per-row kernel with the row weights as cotangent.
    check(*scaled_value_and_grads(
        lambda h, e, b: (w * kernels.cut_bce(
            h, e, ids, b, label_smoothing=a, pos_weight=p, chunk_size=chunk
        )).sum(),
        (h, e, b),
    ))
    # Keras BCE of the multi-hot target (it has no pos_weight).
    if p == 1.0:
        def keras_bce(h, e, b):
            y = reference.multi_hot(ids, v)
            z = reference.logits(h, e, b)
            per_row = keras.losses.binary_crossentropy(y, z, from_logits=True, label_smoothing=a)
            return (w * per_row).sum()

        check(*scaled_value_and_grads(keras_bce, (h, e, b)))
    # Masked rows get no hidden gradient.
    assert (grads[0][w == 0] == 0).all()


def test_upstream_cotangent_scales_the_gradients(rng):
    import torch

    h, e, b = tensors(rng, 7, 4, 26, True)
    ids = torch.tensor(ids_of_kind("dups", 7, 26, rng))
    w = row_weights(rng, 7)
    fn = _fused(ids, w, 0.1, 2.0, 8)
    args = [x.clone().requires_grad_(True) for x in (h, e, b)]
    ones = torch.autograd.grad(fn(*args), args)
    for c in (-3.0, 0.0, 0.5):
        scaled = torch.autograd.grad(fn(*args), args, grad_outputs=torch.tensor(c))
        for got, want in zip(scaled, ones):
            np.testing.assert_allclose(as_numpy(got), c * as_numpy(want), rtol=1e-6, atol=1e-7)


def test_a_second_backward_through_the_same_graph_recomputes_the_gradients(rng):
    """The first backward scales the fused gradients in place and hands them on.

    A second one through the same graph (`retain_graph=True`) gets the
    same gradients, scaled by its own cotangent.
    """
    import torch

    h, e, b = tensors(rng, 6, 4, 19, True)
    ids = torch.tensor(ids_of_kind("dups", 6, 19, rng))
    w = row_weights(rng, 6)
    fn = _fused(ids, w, 0.0, 1.0, 8)
    args = [x.clone().requires_grad_(True) for x in (h, e, b)]
    want = torch.autograd.grad(fn(*args), args)
    value = fn(*args)
    got = torch.autograd.grad(value, args, grad_outputs=torch.tensor(2.0), retain_graph=True)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(as_numpy(g), 2.0 * as_numpy(ref), rtol=1e-6, atol=1e-7)
    for c in (1.0, -0.5):
        again = torch.autograd.grad(value, args, grad_outputs=torch.tensor(c), retain_graph=True)
        for g, ref in zip(again, want):
            np.testing.assert_allclose(as_numpy(g), c * as_numpy(ref), rtol=1e-6, atol=1e-7)


def test_all_rows_masked(rng):
    import torch

    h, e, b = tensors(rng, 5, 3, 17, True)
    ids = torch.tensor(ids_of_kind("mixed", 5, 17, rng))
    w = torch.zeros(5)
    value, grads = scaled_value_and_grads(_fused(ids, w), (h, e, b))
    assert float(value) == 0.0
    assert all((g == 0).all() for g in grads)


def test_bfloat16_inputs(rng):
    import torch

    from keras_cutbce.math import reference

    m, d, v = 16, 8, 70
    h, e, b = tensors(rng, m, d, v, True, dtype="bfloat16")
    ids = torch.tensor(ids_of_kind("dups", m, v, rng))
    w = row_weights(rng, m)
    value, grads = scaled_value_and_grads(_fused(ids, w, 0.1, 1.0, 32), (h, e, b))
    # Reference on the same (bf16-rounded) values in float32.
    want_value, want_grads = scaled_value_and_grads(
        lambda h, e, b: (w * reference.cut_bce(h, e, ids, b, label_smoothing=0.1)).sum(),
        (h.float(), e.float(), b.float()),
    )
    assert value.dtype == torch.float32
    np.testing.assert_allclose(as_numpy(value), as_numpy(want_value), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.bfloat16
        scale = np.abs(as_numpy(want)).max()
        np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=2e-2, atol=1e-2 * scale)


def test_gradcheck_float64(rng):
    import torch

    h, e, b = tensors(rng, 5, 3, 11, True, dtype="float64")
    ids = torch.tensor([[0, 3, 3], [10, -1, 11], [2, 5, 7], [-2, -1, 4], [1, 1, 1]])
    w = torch.tensor([0.5, 0.0, 1.5, 2.0, 0.25], dtype=torch.float64)
    fn = _fused(ids, w, 0.15, 2.0, 4)
    inputs = tuple(x.clone().requires_grad_(True) for x in (h, e, b))
    assert fn(*inputs).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_extreme_logits_are_finite_and_exact():
    import torch

    # D = 1: logits are h * e exactly, so they hit +-200 (and 0).
    h = torch.tensor([[1.0], [-1.0], [0.5]])
    e = torch.tensor([[200.0], [-200.0], [100.0], [0.0], [-150.0]])
    b = torch.tensor([0.0, 0.0, 100.0, 200.0, -50.0])
    ids = torch.tensor([[0, 1], [1, -1], [4, 2]])
    w = torch.tensor([0.7, -1.3, 2.0])
    value, grads = scaled_value_and_grads(_fused(ids, w, chunk=2), (h, e, b))
    hn, en, bn = h.double().numpy(), e.double().numpy(), b.double().numpy()
    z = hn @ en.T + bn
    y = np.zeros_like(z)
    for row, items in enumerate(ids.tolist()):
        for item in items:
            if 0 <= item < z.shape[1]:
                y[row, item] = 1.0
    wn = w.double().numpy()
    want = (wn * (np.logaddexp(0.0, z) - y * z).mean(1)).sum()
    dz = UPSTREAM * wn[:, None] * (1.0 / (1.0 + np.exp(-z)) - y) / z.shape[1]
    assert all(torch.isfinite(x).all() for x in [value] + grads)
    np.testing.assert_allclose(float(value), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(as_numpy(grads[0]), dz @ en, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(as_numpy(grads[1]), dz.T @ hn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(as_numpy(grads[2]), dz.sum(0), rtol=1e-5, atol=1e-6)


MATMULS = ("mm", "addmm", "addmm_", "mv", "addmv", "addmv_", "bmm", "dot", "addr", "addr_")
TILE_OPS = ("sigmoid", "sigmoid_", "softplus", "index_put_") + MATMULS


def _count(ops, names):
    return sum(op in names for op in ops)


@pytest.mark.parametrize("mode", ["no_grad", "nothing_requires_grad"])
def test_no_gradient_work_without_gradients(mode, rng):
    import torch

    h, e, b = tensors(rng, 6, 4, 30, True)
    ids = torch.tensor(ids_of_kind("mixed", 6, 30, rng))
    w = row_weights(rng, 6)
    if mode == "no_grad":
        args = [x.requires_grad_(True) for x in (h, e, b)]
    else:
        args = [h, e, b]
    kernels = chunked()

    def ops_of(fn):
        recorder = TorchOpRecorder()
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad(), recorder:
            out = fn()
        return out, recorder.ops

    value, fused_ops = ops_of(lambda: kernels.cut_bce_weighted_sum(
        *args[:2], ids, args[2], w, label_smoothing=0.1, pos_weight=2.0, chunk_size=8
    ))
    loss, loss_ops = ops_of(lambda: kernels.cut_bce(
        *args[:2], ids, args[2], label_smoothing=0.1, pos_weight=2.0, chunk_size=8
    ))
    assert value.grad_fn is None and not value.requires_grad
    np.testing.assert_allclose(as_numpy(value), as_numpy((w * loss).sum()), rtol=1e-6)
    assert "sigmoid" not in fused_ops and "sigmoid_" not in fused_ops
    assert "index_put_" not in fused_ops
    # The same matmuls as the loss-only kernel (plus the final dot).
    assert _count(fused_ops, MATMULS) == _count(loss_ops, MATMULS) + 1


def test_one_pass_and_a_backward_without_tile_work(rng):
    """Fused: one logits matmul per tile for loss and gradients; backward only scales."""
    import torch

    m, d, v, chunk = 6, 4, 30, 8  # 4 tiles
    tiles = 4
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(ids_of_kind("mixed", m, v, rng))
    w = torch.tensor(rng.uniform(0.5, 1.5, size=m), dtype=torch.float32)  # no zero rows
    kernels = chunked()
    args = [x.detach().clone().requires_grad_(True) for x in (h, e, b)]

    forward = TorchOpRecorder()
    with forward:
        value = kernels.cut_bce_weighted_sum(
            args[0], args[1], ids, args[2], w, label_smoothing=0.1, pos_weight=2.0,
            chunk_size=chunk,
        )
    backward = TorchOpRecorder()
    with backward:
        (UPSTREAM * value).backward()
    assert all(a.grad is not None for a in args)
    assert not any(op in TILE_OPS for op in backward.ops), backward.ops

    per_row_args = [x.detach().clone().requires_grad_(True) for x in (h, e, b)]
    two_pass = TorchOpRecorder()
    with two_pass:
        loss = kernels.cut_bce(
            per_row_args[0], per_row_args[1], ids, per_row_args[2], label_smoothing=0.1,
            pos_weight=2.0, chunk_size=chunk,
        )
        (UPSTREAM * (w * loss).sum()).backward()
    # One logits matmul (addmm, with the bias) per tile instead of two; the
    # gradient products (addmm_, mm, mv per tile) are the same.
    assert forward.ops.count("addmm") == tiles and two_pass.ops.count("addmm") == 2 * tiles
    for op in ("addmm_", "mm"):
        assert forward.ops.count(op) == two_pass.ops.count(op) >= tiles
    # ... and the positives' logits (bmm) once instead of twice.
    assert _count(forward.ops, MATMULS) == _count(two_pass.ops, MATMULS) - tiles - 1 + 1  # + dot
    assert forward.ops.count("softplus") == two_pass.ops.count("softplus")
    sigmoids = ("sigmoid", "sigmoid_")
    assert _count(forward.ops, sigmoids) == _count(two_pass.ops, sigmoids) == tiles + 1
    for got, want in zip(args, per_row_args):
        np.testing.assert_allclose(as_numpy(got.grad), as_numpy(want.grad), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("requires", [(True, False, True), (False, True, False), (True, False, False)])
def test_only_needed_gradients_are_computed(requires, rng):
    import torch

    from keras_cutbce.math import reference

    m, d, v, chunk = 6, 4, 30, 8
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(ids_of_kind("dups", m, v, rng))
    w = row_weights(rng, m)

    recorder = TorchOpRecorder()
    with recorder:
        _, grads = scaled_value_and_grads(_fused(ids, w, 0.1, 2.0, chunk), (h, e, b), requires)
    _, all_grads = scaled_value_and_grads(_fused(ids, w, 0.1, 2.0, chunk), (h, e, b))
    _, ref_grads = scaled_value_and_grads(
        lambda h, e, b: (w * reference.cut_bce(h, e, ids, b, label_smoothing=0.1, pos_weight=2.0)).sum(),
        (h, e, b),
    )
    for got, full, want, needed in zip(grads, all_grads, ref_grads, requires):
        if needed:
            np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(as_numpy(got), as_numpy(full), rtol=1e-6, atol=1e-7)
        else:
            assert got is None
    if not requires[1] and not requires[2]:
        assert "index_put_" not in recorder.ops


def test_never_allocates_the_full_logits(rng):
    import torch

    m, d, v, chunk, length = 64, 8, 1000, 128, 4
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(rng.integers(-1, v, size=(m, length)))
    w = row_weights(rng, m)
    recorder = TorchOpRecorder()
    with recorder:
        _, grads = scaled_value_and_grads(_fused(ids, w, 0.1, 2.0, chunk), (h, e, b))
    assert all(g is not None for g in grads)
    assert recorder.largest < m * v
    # The tile's logits buffer has one spare element (where the other tiles'
    # positives point).
    assert recorder.largest <= max(m * chunk + 1, v * d, m * length * d)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_public_op_rejects_bad_chunk_size_and_kernel_asserts(chunk_size):
    """The public op checks `chunk_size`; the kernel below it only asserts."""
    import torch

    from keras_cutbce.ops import weighted_loss_sum

    with pytest.raises(ValueError, match="chunk_size"):
        weighted_loss_sum(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, 1, dtype=torch.int64),
            torch.ones(2), chunk_size=chunk_size, implementation="chunked",
        )
    with pytest.raises(AssertionError):
        chunked().cut_bce_weighted_sum(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, 1, dtype=torch.int64),
            None, torch.ones(2), label_smoothing=0.0, pos_weight=1.0, chunk_size=chunk_size,
        )


def test_cuda_matches_cpu(rng):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    h, e, b = tensors(rng, 33, 16, 500, True)
    ids = torch.tensor(ids_of_kind("dups", 33, 500, rng))
    w = row_weights(rng, 33)

    def run(device):
        return scaled_value_and_grads(
            _fused(ids.to(device), w.to(device), 0.1, 2.0, 128),
            (h.to(device), e.to(device), b.to(device)),
        )

    cpu_value, cpu_grads = run("cpu")
    gpu_value, gpu_grads = run("cuda")
    assert gpu_value.device.type == "cuda"
    np.testing.assert_allclose(as_numpy(gpu_value.cpu()), as_numpy(cpu_value), rtol=1e-5, atol=1e-6)
    for got, want in zip(gpu_grads, cpu_grads):
        np.testing.assert_allclose(as_numpy(got.cpu()), as_numpy(want), rtol=1e-4, atol=1e-6)
