"""The torch kernels never read a device value on the host.

A host read (`.item()`, `int(tensor)`, `bool(tensor)`, a boolean-mask index,
`nonzero`) is a device-to-host sync on CUDA and a graph break under
`torch.compile`. Checked on CPU: every aten op of a forward and backward
pass is recorded, and the loss is compiled with `fullgraph=True` (which
fails on any graph break). Runs only under KERAS_BACKEND=torch.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch kernels: torch backend only"
)

# Ops that copy a device value to the host, or whose output shape depends on one.
HOST_READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique")


def _inputs(rng, m=6, d=4, v=37, length=3):
    import torch

    h = torch.tensor(rng.normal(size=(m, d)), dtype=torch.float32, requires_grad=True)
    e = torch.tensor(rng.normal(size=(v, d)), dtype=torch.float32, requires_grad=True)
    b = torch.tensor(rng.normal(size=(v,)), dtype=torch.float32, requires_grad=True)
    ids = rng.integers(-1, v, size=(m, length))
    ids[0, 1] = ids[0, 0]  # a duplicate
    ids[1, :] = -1  # a row without targets
    weights = torch.tensor(rng.uniform(0.5, 1.5, size=m), dtype=torch.float32)
    weights[2] = 0.0  # a masked row
    return h, e, b, torch.tensor(ids), weights


def _recorded_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    recorder = Recorder()
    with recorder:
        fn()
    return recorder.ops


def _losses():
    from keras_cutbce.backends.torch import chunked

    options = dict(label_smoothing=0.1, pos_weight=2.0, chunk_size=16)

    def per_row(h, e, b, ids, weights):
        return (weights * chunked.cut_bce(h, e, ids, b, **options)).sum()

    def weighted_sum(h, e, b, ids, weights):
        return chunked.cut_bce_weighted_sum(h, e, ids, b, weights, **options)

    return {"cut_bce": per_row, "cut_bce_weighted_sum": weighted_sum}


@pytest.mark.parametrize("name", ["cut_bce", "cut_bce_weighted_sum"])
@pytest.mark.parametrize("cotangent", [1.0, 2.5])
def test_forward_and_backward_make_no_host_read(name, cotangent, rng):
    import torch

    loss_fn = _losses()[name]
    h, e, b, ids, weights = _inputs(rng)

    def step():
        loss = loss_fn(h, e, b, ids, weights)
        torch.autograd.grad(loss * cotangent, (h, e, b))

    ops = _recorded_ops(step)
    assert "mm" in ops or "addmm" in ops  # the recorder sees the kernel's ops
    assert not [op for op in ops if op in HOST_READS]


@pytest.mark.parametrize("implementation", ["chunked", "triton"])
@pytest.mark.parametrize("family", ["bce", "softmax"])
def test_the_public_losses_make_no_host_read_and_no_tensor_of_host_data(family, implementation, rng,
                                                                       monkeypatch):
    """The Keras losses and the per-position ops, forward and backward, from device ids: no host read and
    no tensor made of host data (a Python number as a Keras op's operand is copied from the host, which
    syncs on CUDA). The Triton kernels are stood in for (their launches record nothing here)."""
    import torch

    import keras_cutbce
    from keras_cutbce.backends.torch.triton import launch

    if implementation == "triton":
        from tests.cutbce.test_triton_dispatch import _FakeKernels

        monkeypatch.setattr(launch, "device_problem", lambda device: None)
        fake = _FakeKernels()
        monkeypatch.setattr(launch, "kernels", lambda device: fake)
    loss_class, op = {
        "bce": (keras_cutbce.CutBCELoss, keras_cutbce.cut_binary_crossentropy),
        "softmax": (keras_cutbce.CutSoftmaxLoss, keras_cutbce.cut_categorical_crossentropy),
    }[family]
    h, e, b, ids, weights = _inputs(rng, length=4)
    table = keras.Variable(e.detach().numpy())
    losses = {"mean": loss_class(table, implementation=implementation),
              "sum": loss_class(table, implementation=implementation, reduction="sum")}

    def step():
        total = losses["mean"](ids, h) + losses["sum"](ids, h, sample_weight=weights)
        total = total + op(h, e, ids, b, implementation=implementation).sum()
        if implementation == "chunked":  # the stand-in kernels have no backward
            torch.autograd.grad(total, (h,))

    step()  # builds the losses
    ops = _recorded_ops(step)
    assert "sort" in ops  # the recorder sees the ops
    assert not [op for op in ops if op in HOST_READS + ("lift_fresh",)]


@pytest.mark.parametrize("name", ["cut_bce", "cut_bce_weighted_sum"])
def test_compiles_without_graph_break(name, rng):
    import torch

    loss_fn = _losses()[name]
    h, e, b, ids, weights = _inputs(rng)
    args = (h, e, b)
    want = loss_fn(h, e, b, ids, weights)
    want_grads = torch.autograd.grad(want, args)

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    got = compiled(h, e, b, ids, weights)
    got_grads = torch.autograd.grad(got, args)
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)


def test_triton_host_side_compiles_without_graph_break(rng):
    """The Triton path's host code before a launch (fits, operand dtype, fp32 precision, tiles, tile flags)."""
    import torch

    from keras_cutbce.backends.torch.triton import config
    from keras_cutbce.backends.torch.triton import launch

    def host_side(h, e, targets):
        operands = launch.operand_dtype(h)
        settings = config.choose(h.shape[1], operands, False, 90, launch.triton_precision())
        flags = launch._tile_flags(targets, *settings.rows_block[:2], e.shape[0], softmax=False)
        return flags, launch.fits(h, e, None)

    h, e, _, ids, _ = _inputs(rng, v=300)
    targets = torch.where(ids < 300, ids, -1).to(torch.int32)
    torch._dynamo.reset()
    got = torch.compile(host_side, fullgraph=True, backend="aot_eager")(h.detach(), e.detach(), targets)
    want = host_side(h.detach(), e.detach(), targets)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and int(want[0].sum()) > 1

    # The precision is read at trace time: changing it re-traces (Dynamo's global-state guard).
    precision = torch.compile(lambda x: x * (launch.triton_precision() == "ieee"), fullgraph=True,
                              backend="aot_eager")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert float(precision(torch.ones(()))) == 1.0
        torch.set_float32_matmul_precision("high")
        assert float(precision(torch.ones(()))) == 0.0
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("k", [1, 5, 37])
def test_top_k_and_rank_counts_make_no_host_read(k, rng, monkeypatch):
    """Retrieval with ties (integer logits) and exclusions reads nothing on the host
    off the CPU (on CPU, where a host read is free, ties are checked on the host)."""
    import torch

    from keras_cutbce.backends.torch import retrieval

    monkeypatch.setattr(retrieval, "host_reads_are_free", lambda device: False)

    h = torch.tensor(rng.integers(-2, 3, size=(6, 4)), dtype=torch.float32)
    e = torch.tensor(rng.integers(-2, 3, size=(37, 4)), dtype=torch.float32)
    exclude = torch.tensor(rng.integers(-1, 37, size=(6, 3)))
    result = {}

    def retrieve():
        result["top"] = retrieval.top_k(h, e, k, None, exclude, chunk_size=16)
        result["count"] = retrieval.count_above(
            h, e, None, torch.ones(6), torch.full((6,), 37), chunk_size=16
        )
        result["rank"] = retrieval.count_above(
            h, e, None, torch.zeros(6), torch.arange(6), exclude, chunk_size=16
        )

    ops = _recorded_ops(retrieve)
    assert "topk" in ops or "sort" in ops  # the recorder sees the kernel's ops
    assert not [op for op in ops if op in HOST_READS]
    z = (h @ e.T).numpy()
    z[np.arange(6)[:, None], np.where(exclude.numpy() >= 0, exclude.numpy(), 0)] = np.where(
        exclude.numpy() >= 0, -np.inf, z[np.arange(6)[:, None], 0]
    )
    want_ids = np.argsort(-z, axis=1, kind="stable")[:, :k]
    got_scores, got_ids = result["top"]
    filled = np.isfinite(np.take_along_axis(z, want_ids, 1))
    np.testing.assert_array_equal(np.where(filled, got_ids.numpy(), -1), np.where(filled, want_ids, -1))
    np.testing.assert_array_equal(result["count"].numpy(), (h @ e.T >= 1.0).sum(1).numpy())
    columns = np.arange(37)[None, :]
    dense = (h @ e.T).numpy()
    above = (dense > 0) | ((dense == 0) & (columns < np.arange(6)[:, None]))
    above &= columns != np.arange(6)[:, None]
    for row, excluded in enumerate(exclude.numpy()):
        above[row, excluded[excluded >= 0]] = False
    np.testing.assert_array_equal(result["rank"].numpy(), above.sum(1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_sync_free_top_k_matches_a_stable_sort(dtype, rng):
    """The sync-free top k (`_top_k_by_keys`) and the CPU one agree with a stable sort
    of `-x`: ties to the lower column, -0.0 tied with +0.0, infinities, NaN first."""
    import torch

    from keras_cutbce.backends.torch import retrieval

    for trial in range(30):
        x = torch.tensor(rng.integers(-3, 4, size=(5, 17)), dtype=getattr(torch, dtype))
        x[0, 3], x[1, 2], x[2, 5] = -0.0, -float("inf"), float("inf")
        if trial % 5 == 0:
            x[3, 4] = float("nan")
        k = int(rng.integers(1, 18))
        want_values, want_columns = torch.sort(x, dim=1, descending=True, stable=True)
        for top_k in (retrieval._top_k_by_keys, retrieval._top_k_reading_ties):
            values, columns = top_k(x, k)
            np.testing.assert_array_equal(columns.numpy(), want_columns[:, :k].numpy())
            np.testing.assert_array_equal(values.double().numpy(), want_values[:, :k].double().numpy())


class _NoOpLaunch:
    """The Triton kernels' stand-in: `kernel[grid](...)` launches nothing (what Dynamo traces is the host code)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def warmup(self, *args, grid, **kwargs):  # compiles nothing: as the interpreter's
        return None

    rows_kernel = columns_kernel = property(lambda self: self)


@pytest.mark.slow
@pytest.mark.parametrize("implementation, family", [("chunked", "bce"), ("triton", "bce"),
                                                    ("triton", "softmax")])
def test_a_training_step_of_the_public_op_compiles_without_graph_break(family, implementation, rng,
                                                                       monkeypatch):
    """The public op (checks, the registry's dispatch, the kernel's host code) and its backward in one
    graph (`fullgraph=True`), once the implementation's module is imported (an eager call imports it;
    `import_module` would break the graph). Triton: its launches are no-ops (`_NoOpLaunch`)."""
    import torch

    import keras_cutbce
    from keras_cutbce.backends.torch.triton import launch

    op = keras_cutbce.cut_binary_crossentropy if family == "bce" else keras_cutbce.cut_categorical_crossentropy
    if implementation == "triton":
        monkeypatch.setattr(launch, "kernels", lambda device: _NoOpLaunch())
        monkeypatch.setattr(launch, "device_problem", lambda device: None)
    h, e, b, ids, _ = _inputs(rng)

    def step(h, e, b, ids):
        return op(h, e, ids, b, implementation=implementation).sum()

    step(h, e, b, ids)  # imports the implementation's module
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(h, e, b, ids)
    loss.backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (h, e, b))


def test_the_compute_capability_is_a_constant_under_torch_compile(monkeypatch):
    """`config.device_arch` is read once at trace time: Dynamo does not trace the capability query."""
    import torch

    from keras_cutbce.backends.torch.triton import config

    @torch._dynamo.disable  # a call Dynamo cannot trace: `fullgraph=True` fails if it is traced
    def capability(device=None):
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    torch._dynamo.reset()
    arch = torch.compile(lambda x: x * config.device_arch(torch.device("cuda", 0)), fullgraph=True,
                         backend="aot_eager")
    assert float(arch(torch.ones(()))) == 90.0


@pytest.mark.parametrize("metric", ["TopKRetrieval", "MeanReciprocalRank", "ThresholdConfusion"])
def test_the_retrieval_metrics_update_without_a_tensor_of_host_data(metric, rng, monkeypatch):
    """An update from device inputs makes no tensor of host data (`lift_fresh`: a copy, a sync on CUDA) and
    reads nothing on the host; the retrieval kernels take their CUDA path (no tie read on the host)."""
    import torch

    import keras_cutbce
    from keras_cutbce.backends.torch import retrieval

    monkeypatch.setattr(retrieval, "host_reads_are_free", lambda device: False)
    h, e, _, ids, weights = _inputs(rng, length=4)
    options = {"TopKRetrieval": dict(k=(1, 5), exclude_ids=[3]), "MeanReciprocalRank": dict(exclude_ids=[3, 7]),
               "ThresholdConfusion": {}}[metric]
    instance = getattr(keras_cutbce, metric)(keras.Variable(e.detach().numpy()), **options)
    h = h.detach()
    instance.update_state(ids, h, sample_weight=weights)  # builds
    ops = _recorded_ops(lambda: instance.update_state(ids, h, sample_weight=weights))
    assert "mm" in ops or "addmm" in ops
    assert not [op for op in ops if op in HOST_READS + ("lift_fresh",)]
    assert all(np.isfinite(float(v)) for v in instance.result().values())
