"""The torch chunked CutBCE kernel against the dense reference and Keras BCE.

Runs only under KERAS_BACKEND=torch; torch is imported inside the tests. The
checks shared with the other backends (odd shapes against the reference and
Keras BCE, low-precision inputs, id dtypes, extreme logits, dispatch through
ops) are in tests/cutbce/test_chunked.py.
"""

import keras
import numpy as np
import pytest

from tests.backend_utils import TorchOpRecorder
from tests.cutbce.torch_inputs import (
    as_numpy,
    chunked,
    ids_of_kind,
    loss_and_grads,
    tensors,
)

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch chunked kernel: torch backend only"
)


@pytest.mark.parametrize("zero_rows", ["some", "all"])
def test_rows_with_zero_cotangent(zero_rows, rng):
    """Masked positions (cotangent 0) are skipped in the backward pass, exactly."""
    import torch

    from keras_cutbce.math import reference

    m, d, v = 10, 4, 45
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(ids_of_kind("dups", m, v, rng))
    cotangent = torch.tensor(rng.normal(size=(m,)), dtype=torch.float32)
    cotangent[[0, 3, 4, 9] if zero_rows == "some" else slice(None)] = 0.0
    _, grads = loss_and_grads(
        lambda h, e, b: chunked().cut_bce(
            h, e, ids, b, label_smoothing=0.1, pos_weight=2.0, chunk_size=16
        ),
        h, e, b, cotangent,
    )
    _, ref_grads = loss_and_grads(
        lambda h, e, b: reference.cut_bce(h, e, ids, b, label_smoothing=0.1, pos_weight=2.0),
        h, e, b, cotangent,
    )
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-6)
    assert (grads[0][cotangent == 0] == 0).all()
    if zero_rows == "all":
        assert all((g == 0).all() for g in grads)


def test_pos_weight_changes_the_loss(rng):
    """pos_weight != 1 is not silently ignored: it moves the loss of rows with positives."""
    import torch

    h, e, b = tensors(rng, 4, 5, 20, True)
    ids = torch.tensor([[1, 2], [3, -1], [-1, -1], [4, 4]])
    kernels = chunked()
    one = kernels.cut_bce(h, e, ids, b, label_smoothing=0.0, pos_weight=1.0, chunk_size=8)
    three = kernels.cut_bce(h, e, ids, b, label_smoothing=0.0, pos_weight=3.0, chunk_size=8)
    changed = (one - three).abs() > 1e-6
    assert changed.tolist() == [True, True, False, True]


def test_gradcheck_float64(rng):
    import torch

    h, e, b = tensors(rng, 4, 3, 11, True, dtype="float64")
    ids = torch.tensor([[0, 3, 3], [10, -1, 11], [2, 5, 7], [-2, -1, 4]])
    kernels = chunked()

    def fn(h, e, b):
        return kernels.cut_bce(
            h, e, ids, b, label_smoothing=0.15, pos_weight=2.0, chunk_size=4
        )

    inputs = tuple(x.clone().requires_grad_(True) for x in (h, e, b))
    assert fn(*inputs).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_no_gradient_work_under_no_grad(rng):
    import torch

    h, e, b = tensors(rng, 6, 4, 30, True)
    args = [x.requires_grad_(True) for x in (h, e, b)]
    ids = torch.tensor(ids_of_kind("mixed", 6, 30, rng))
    recorder = TorchOpRecorder()
    with torch.no_grad(), recorder:
        loss = chunked().cut_bce(
            *args[:2], ids, args[2], label_smoothing=0.0, pos_weight=1.0, chunk_size=8
        )
    assert loss.grad_fn is None and not loss.requires_grad
    assert "sigmoid" not in recorder.ops and "sigmoid_" not in recorder.ops
    assert "index_put_" not in recorder.ops


def _count_matmuls(ops):
    return sum(op in ("mm", "addmm", "addmm_", "mv", "addmv", "addmv_", "bmm") for op in ops)


def test_only_needed_gradients_are_computed(rng):
    import torch

    from keras_cutbce.math import reference

    m, d, v, chunk = 6, 4, 30, 8  # 4 tiles
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(ids_of_kind("mixed", m, v, rng))
    cotangent = torch.tensor(rng.normal(size=(m,)), dtype=torch.float32)
    kernels = chunked()

    def backward_ops(requires):
        args = [x.detach().clone().requires_grad_(r) for x, r in zip((h, e, b), requires)]
        loss = kernels.cut_bce(
            args[0], args[1], ids, args[2], label_smoothing=0.0, pos_weight=1.0,
            chunk_size=chunk,
        )
        recorder = TorchOpRecorder()
        with recorder:
            (loss * cotangent).sum().backward()
        return args, recorder.ops

    all_args, all_ops = backward_ops((True, True, True))
    h_args, h_ops = backward_ops((True, False, False))
    e_args, e_ops = backward_ops((False, True, False))
    assert h_args[1].grad is None and h_args[2].grad is None
    assert e_args[0].grad is None and e_args[2].grad is None
    np.testing.assert_allclose(as_numpy(h_args[0].grad), as_numpy(all_args[0].grad), rtol=1e-6)
    np.testing.assert_allclose(as_numpy(e_args[1].grad), as_numpy(all_args[1].grad), rtol=1e-6)
    # Per tile: logits + one product per needed gradient (hidden, table, bias).
    assert _count_matmuls(h_ops) < _count_matmuls(all_ops)
    assert _count_matmuls(e_ops) < _count_matmuls(all_ops)
    assert "index_put_" not in h_ops and "index_put_" in all_ops

    _, ref_grads = loss_and_grads(
        lambda h, e, b: reference.cut_bce(h, e, ids, b), h, e, b, cotangent
    )
    np.testing.assert_allclose(as_numpy(h_args[0].grad), as_numpy(ref_grads[0]), rtol=1e-5, atol=1e-6)


def test_never_allocates_the_full_logits(rng):
    import torch

    m, d, v, chunk, length = 64, 8, 1000, 128, 4
    h, e, b = tensors(rng, m, d, v, True)
    args = [x.requires_grad_(True) for x in (h, e, b)]
    ids = torch.tensor(rng.integers(-1, v, size=(m, length)))
    recorder = TorchOpRecorder()
    with recorder:
        loss = chunked().cut_bce(
            args[0], args[1], ids, args[2], label_smoothing=0.1, pos_weight=2.0,
            chunk_size=chunk,
        )
        (loss * torch.linspace(-1, 1, m)).sum().backward()
    assert all(x.grad is not None for x in args)
    assert recorder.largest < m * v
    # The tile's logits buffer has one spare element (where the other tiles'
    # positives point).
    assert recorder.largest <= max(m * chunk + 1, v * d, m * length * d)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_public_op_rejects_bad_chunk_size_and_kernel_asserts(chunk_size):
    """The public op checks `chunk_size`; the kernel below it only asserts."""
    import torch

    from keras_cutbce import cut_binary_crossentropy

    with pytest.raises(ValueError, match="chunk_size"):
        cut_binary_crossentropy(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, 1, dtype=torch.int64),
            chunk_size=chunk_size, implementation="chunked",
        )
    with pytest.raises(AssertionError):
        chunked().cut_bce(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, 1, dtype=torch.int64),
            None, label_smoothing=0.0, pos_weight=1.0, chunk_size=chunk_size,
        )


def test_cuda_matches_cpu(rng):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    h, e, b = tensors(rng, 33, 16, 500, True)
    ids = torch.tensor(ids_of_kind("dups", 33, 500, rng))
    cotangent = torch.tensor(rng.normal(size=(33,)), dtype=torch.float32)
    kernels = chunked()

    def run(device):
        return loss_and_grads(
            lambda h, e, b: kernels.cut_bce(
                h, e, ids.to(device), b, label_smoothing=0.1, pos_weight=2.0, chunk_size=128
            ),
            h.to(device), e.to(device), b.to(device), cotangent.to(device),
        )

    cpu_loss, cpu_grads = run("cpu")
    gpu_loss, gpu_grads = run("cuda")
    assert gpu_loss.device.type == "cuda"
    np.testing.assert_allclose(as_numpy(gpu_loss.cpu()), as_numpy(cpu_loss), rtol=1e-4, atol=1e-6)
    for got, want in zip(gpu_grads, cpu_grads):
        assert got.device.type == "cuda"
        np.testing.assert_allclose(as_numpy(got.cpu()), as_numpy(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["rows", "transposed", "bias"])
def test_positives_gradients_sum_repeats_as_index_add_did(layout, rng):
    """`add_rows`: `index_put_` with accumulate (sorted, no atomics on CUDA), equal to `index_add_` bit for bit
    on CPU, into a `[V, D]` gradient, the loop's transposed `[D, V]` buffer (in place) and a bias."""
    import torch

    from keras_cutbce.backends.torch.chunked import add_rows

    v, d, n = 37, 5, 300  # every id repeated about 8 times
    index = torch.tensor(rng.integers(0, v, size=n))
    values = torch.tensor(rng.normal(size=(n, d)), dtype=torch.float32)
    if layout == "bias":
        values = values[:, 0].contiguous()
    start = torch.tensor(rng.normal(size=(v, d)), dtype=torch.float32)
    out = {"rows": start.clone(), "transposed": start.T.contiguous().T, "bias": start[:, 0].clone()}[layout]
    buffer = out.data_ptr()
    want = out.clone().index_add_(0, index, values)
    add_rows(out, index, values)
    assert out.data_ptr() == buffer and torch.equal(out, want)


def test_a_training_step_is_deterministic_and_unchanged_under_torchs_deterministic_mode(rng):
    """The positives' table and bias gradients never go through `index_add_` (atomic on CUDA); under
    `torch.use_deterministic_algorithms(True)` the step runs (no op refuses it) to the same bits."""
    import torch

    m, d, v = 24, 6, 70
    h, e, b = tensors(rng, m, d, v, True)
    ids = torch.tensor(rng.integers(0, v // 4, size=(m, 5)))  # ids repeated across rows

    def step():
        args = [x.detach().clone().requires_grad_(True) for x in (h, e, b)]
        recorder = TorchOpRecorder()
        with recorder:
            chunked().cut_bce(*args[:2], ids, args[2], label_smoothing=0.1, pos_weight=2.0,
                              chunk_size=16).sum().backward()
        return [x.grad for x in args], recorder.ops

    grads, ops = step()
    assert "index_put_" in ops and "index_add" not in ops and "index_add_" not in ops
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        again, _ = step()
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(g, a) for g, a in zip(grads, again))
