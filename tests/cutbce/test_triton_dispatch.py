"""Which kernel runs under `implementation="auto"` and `"triton"` (no kernel is launched here).

CUDA tensors on torch run the Triton kernels when Triton is installed and the
GPU's compute capability is one the compile suite tests (sm_80, sm_90; faked
here), the chunked loop otherwise; CPU tensors run the chunked loop under `"auto"`;
`"triton"` is torch only and, on CPU tensors outside the interpreter, says
how to run it.
"""

import importlib.util

import keras
import numpy as np
import pytest

import keras_cutbce
from keras_cutbce import cut_binary_crossentropy
from keras_cutbce import cut_categorical_crossentropy
from keras_cutbce import registry

TRITON = importlib.util.find_spec("triton") is not None


def test_auto_order_on_a_gpu(monkeypatch):
    assert registry.auto("cut_bce", "torch", "gpu") == ("triton" if TRITON else "chunked")
    for op in ("cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum"):
        assert registry.auto(op, "torch", "gpu") == ("triton" if TRITON else "chunked")
    assert registry.auto("cut_softmax", "torch", "cpu") == "chunked"
    assert registry.auto("top_k", "torch", "gpu") == "chunked"  # no Triton retrieval
    assert registry.auto("cut_bce", "jax", "gpu") == "chunked"
    assert registry.auto("cut_bce", "torch", "cpu") == "chunked"
    monkeypatch.setitem(registry.REQUIRES, "triton", "a_library_that_is_not_installed")
    assert registry.auto("cut_bce", "torch", "gpu") == "chunked"


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="the other backends refuse it")
def test_triton_is_torch_only():
    with pytest.raises(ValueError, match="PyTorch"):
        cut_binary_crossentropy(np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                                np.zeros((2, 1), "int32"), implementation="triton")


@pytest.fixture
def any_device(monkeypatch):
    """The kernels' device check passes on CPU tensors (their entry points are replaced: nothing runs)."""
    from keras_cutbce.backends.torch.triton import launch

    monkeypatch.setattr(launch, "device_problem", lambda device: None)


# Each family's public op and its kernels' entry points.
FAMILIES = {"bce": (cut_binary_crossentropy, "cut_bce"),
            "softmax": (cut_categorical_crossentropy, "cut_softmax")}


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch routing")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cpu_tensors_run_the_chunked_loop_under_auto(family, monkeypatch):
    from keras_cutbce.backends.torch.triton import launch

    def refuse(*args, **kwargs):
        raise AssertionError("auto routed CPU tensors to the Triton kernels")

    public_op, op = FAMILIES[family]
    monkeypatch.setattr(launch, op, refuse)
    monkeypatch.setattr(launch, op + "_weighted_sum", refuse)
    with keras.device("cpu"):  # on a GPU machine Keras would put the inputs on CUDA
        loss = public_op(np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                         np.zeros((2, 1), "int32"))
    assert tuple(loss.shape) == (2,) and loss.device.type == "cpu"


@pytest.mark.skipif(keras.backend.backend() != "torch" or not TRITON, reason="torch with Triton")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_on_cpu_outside_the_interpreter_says_how(family, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with keras.device("cpu"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        FAMILIES[family][0](np.ones((2, 3), "float32"), np.ones((5, 3), "float32"),
                            np.zeros((2, 1), "int32"), implementation="triton")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch routing")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16", "autocast"])
def test_the_kernels_multiply_in_the_compute_dtype_of_every_policy(family, policy, monkeypatch,
                                                                   any_device):
    """The products' operand dtype is the policy's compute dtype (the float32 table cast to
    it; float32 accumulation), and `torch.autocast`'s dtype under autocast; the gradients'
    stored dtypes (which decide the hi/lo split) are the hidden states' and the table's."""
    import contextlib

    import torch

    from keras_cutbce import CutBCELoss, CutSoftmaxLoss
    from keras_cutbce.backends.torch import chunked as kernel
    from keras_cutbce.backends.torch.triton import launch
    from tests.backend_utils import dtype_policy

    seen = []

    def tile_loop(*args, operands, stored, family, **kwargs):  # records what the kernels would take
        seen.append((operands, stored))
        return kernel.dense_pass(*args, family=family, **kwargs)

    monkeypatch.setattr(launch, "dense_pass", tile_loop)
    autocast = policy == "autocast"
    with dtype_policy("float32" if autocast else policy) as compute:
        items = keras.layers.Embedding(40, 8)
        items.build((None,))
        hidden = keras.ops.cast(np.random.default_rng(0).normal(size=(6, 8)), compute)
        ids = np.random.default_rng(1).integers(0, 40, size=(6, 2)).astype("int32")
        scope = torch.autocast(hidden.device.type, torch.bfloat16) if autocast else contextlib.nullcontext()
        loss_class = CutBCELoss if family == "bce" else CutSoftmaxLoss
        with scope:
            FAMILIES[family][0](hidden, items, ids, implementation="triton")
            loss_class(items, implementation="triton")(ids, hidden)
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[compute]
    stored = (want, torch.float32)
    assert seen == [(torch.bfloat16, stored) if autocast else (want, stored)] * 2


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch routing")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype, dim, fits", [
    ("float32", 8, True), ("bfloat16", 200, True), ("float64", 8, False),
    ("float32", 200, False), ("bfloat16", 300, False),
])
def test_inputs_the_kernels_do_not_take_run_the_chunked_loop(family, dtype, dim, fits, monkeypatch,
                                                            any_device):
    """The registry's `FITS` entry: float64, `D > 256` and fp32 products at full precision
    with `D > 128` run the chunked loop under `"triton"`; the others the kernels."""
    ran = _routes(monkeypatch, family, dtype, dim, "triton")
    route = "triton" if fits else "chunked"
    assert ran == [(route, op) for op in _ops(family)]


def _ops(family):
    return FAMILIES[family][1], FAMILIES[family][1] + "_weighted_sum"


def _routes(monkeypatch, family, dtype, dim, implementation):
    """`[(route, kernel op)]` of the public op and its Keras loss (the weighted sum) under `implementation`.

    The Triton entry points are recorded, not run; the chunked loop runs.
    """
    import torch

    from keras_cutbce.backends.torch import chunked
    from keras_cutbce.backends.torch.triton import launch

    ran = []
    for name in _ops(family):
        zeros = torch.zeros(2) if name == FAMILIES[family][1] else torch.zeros(())
        monkeypatch.setattr(launch, name, lambda *a, name=name, zeros=zeros, **k: (
            ran.append(("triton", name)), zeros)[1])
        real = getattr(chunked, name)
        monkeypatch.setattr(chunked, name, lambda *a, real=real, name=name, **k: (
            ran.append(("chunked", name)), real(*a, **k))[1])
    hidden = torch.ones((2, dim), dtype=getattr(torch, dtype))
    table = torch.ones((5, dim), dtype=getattr(torch, dtype))
    ids = np.zeros((2, 1), "int32")
    FAMILIES[family][0](hidden, table, ids, implementation=implementation)
    loss_class = keras_cutbce.CutBCELoss if family == "bce" else keras_cutbce.CutSoftmaxLoss
    loss_class(table, implementation=implementation)(ids, hidden)  # the weighted sum
    return ran


# (major, minor) -> the operands the kernels run there: the compile suite's compute capabilities only, and on
# sm_86, sm_89 and sm_100 16-bit operands only (fp32 spills there).
_FULL, _HALF = ("float32", "bfloat16"), ("bfloat16",)
CAPABILITIES = {(7, 0): (), (7, 5): (), (8, 0): _FULL, (8, 6): _HALF, (8, 9): _HALF,
                (9, 0): _FULL, (10, 0): _HALF, (12, 0): ()}


@pytest.mark.skipif(keras.backend.backend() != "torch" or not TRITON, reason="torch with Triton")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_the_kernels_run_only_on_the_compute_capabilities_the_compile_suite_tests(
        family, capability, monkeypatch):
    """A faked CUDA device: `"auto"` runs the kernels where the compile suite compiles them without spills
    (for the operands it does), the chunked loop elsewhere; `"triton"` on an arch it does not compile raises
    a ValueError naming the capability and the way out."""
    import torch

    from keras_cutbce.backends.torch.triton import config, launch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    real = launch.device_problem  # the real check, of a CUDA device of that capability
    monkeypatch.setattr(launch, "device_problem", lambda device: real(torch.device("cuda", 0)))
    monkeypatch.setattr(registry, "_platform", lambda tensor: "gpu")
    arch = 10 * capability[0] + capability[1]
    assert config.device_arch(torch.device("cuda", 0)) == arch
    monkeypatch.setattr(config, "device_arch", lambda device: arch)  # the CPU stand-in tensors' too
    runs = CAPABILITIES[capability]
    assert (arch in config.COMPILED_ARCHS) == bool(runs)
    for dtype in _FULL:
        route = "triton" if dtype in runs else "chunked"
        assert _routes(monkeypatch, family, dtype, 8, "auto") == [(route, op) for op in _ops(family)], dtype
    if runs:
        assert _routes(monkeypatch, family, "bfloat16", 8, "triton") == [
            ("triton", op) for op in _ops(family)]
    else:
        listed = ".*".join(f"sm_{a}" for a in config.COMPILED_ARCHS)
        with pytest.raises(ValueError, match=rf"{listed}.* is sm_{arch}\..*\"chunked\""):
            _routes(monkeypatch, family, "float32", 8, "triton")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch kernels' inputs")
def test_tile_flags_mark_exactly_the_tiles_holding_a_positive():
    """BCE's kernels mask positives only in flagged tiles: a tile missed here would leave a positive in."""
    import torch

    from keras_cutbce.backends.torch.triton import launch

    targets = torch.tensor([[5, -1], [70, 5], [-1, -1], [129, 0], [64, -1]], dtype=torch.int32)
    flags = launch._tile_flags(targets, block_m=2, block_n=32, vocab_size=130, softmax=False)
    # 3 row blocks x 5 tiles (+ the padding slot): block 0 rows 0-1, tiles 0 and 2; block 1 rows 2-3,
    # tiles 4 and 0; block 2 row 4, tile 2.
    want = torch.zeros(16, dtype=torch.int8)
    want[[0 * 5 + 0, 0 * 5 + 2, 1 * 5 + 4, 1 * 5 + 0, 2 * 5 + 2, 15]] = 1
    assert torch.equal(flags, want)
    assert launch._tile_flags(targets, 2, 32, 130, softmax=True) is targets  # softmax masks none


class _Compiled:
    """What Triton returns for a compiled kernel: registers and shared memory (here 2 programs an SM)."""

    n_regs, run, metadata = 96, None, type("Metadata", (), {"shared": 32768})


class _FakeKernels:
    """The kernels' stand-in: compiling gives `_Compiled`; a launch records its grid and its tensors'
    device, runs nothing and returns the compiled kernel, as Triton's launch does."""

    def __init__(self):
        self.grids, self.devices, self.rows_kernel, self.columns_kernel = [], [], self, self

    def warmup(self, *args, grid, **options):
        return _Compiled()

    def __getitem__(self, grid):
        def launch(first, *args, **options):
            self.grids.append(grid)
            self.devices.append(first.device)
            return _Compiled()
        return launch


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch kernels' launches")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_first_launch_already_splits_the_vocabulary_as_every_later_one(family, any_device,
                                                                            monkeypatch):
    """The rows kernel's splits follow the programs an SM holds, read from the kernel compiled before
    its first launch: the first call's grid is every later call's (bitwise reproducible steps)."""
    import torch

    from keras_cutbce.backends.torch.triton import config, launch

    fake = _FakeKernels()
    monkeypatch.setattr(launch, "kernels", lambda device: fake)
    monkeypatch.setattr(launch, "_PROGRAMS", {}, raising=False)  # compiled by other tests' fakes
    op = FAMILIES[family][0]
    hidden, table = torch.ones(8, 32), torch.ones(4000, 32)
    ids = torch.zeros(8, 1, dtype=torch.int32)
    for _ in range(2):
        op(hidden, table, ids, implementation="triton")
    first, second = fake.grids[0], fake.grids[-1]
    assert first == second
    block_m, block_n, warps, _ = config.choose(32, torch.float32, False, 90, launch.triton_precision(),
                                               family=family).rows_block
    programs = config.programs_per_sm(_Compiled.n_regs, warps, _Compiled.metadata.shared, 90)
    assert programs > 1
    tiles = -(-4000 // block_n)
    # Keras puts the inputs on its device: a GPU's SM count where there is one.
    per_split = -(-tiles // config.num_splits(8, tiles, block_m, fake.devices[0], programs))
    assert first == (1, -(-tiles // per_split))


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch kernels' launches")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("wrt", ["all", "table"])
def test_the_per_position_op_trains_in_two_launches(family, wrt, monkeypatch):
    """Forward: the rows kernel once (the loss, and the hidden gradient of a unit cotangent); backward: the
    columns kernel alone (softmax's log-sum-exp kept from the forward pass), as the Keras loss's fused step."""
    import torch

    from keras_cutbce.backends.torch.triton import launch

    fake = _FakeKernels()
    monkeypatch.setattr(launch, "device_problem", lambda device: None)
    monkeypatch.setattr(launch, "kernels", lambda device: fake)
    monkeypatch.setattr(launch, "_PROGRAMS", {}, raising=False)
    hidden = torch.ones(8, 32, requires_grad=wrt == "all")
    table, bias = torch.ones(400, 32, requires_grad=True), torch.ones(400, requires_grad=True)
    ids = torch.tensor([[1, 7]] * 8)
    loss = FAMILIES[family][0](hidden, table, ids, bias, implementation="triton")
    assert [len(grid) for grid in fake.grids] == [2]  # the rows kernel's (row blocks, splits)
    leaves = (hidden, table, bias) if wrt == "all" else (table, bias)
    torch.autograd.grad((loss * torch.arange(8.0)).sum(), leaves)
    assert [len(grid) for grid in fake.grids] == [2, 1]  # then the columns kernel's (vocabulary blocks,)
