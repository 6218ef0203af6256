"""Cross-backend parity of `cut_binary_crossentropy` (every implementation on this backend).

Each case checks the loss and the gradients for hidden, table and bias, under
a random cotangent, against Keras's own dense `binary_crossentropy` and the
dense reference formula.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_cutbce import CutBCELoss
from keras_cutbce import cut_binary_crossentropy
from keras_cutbce.math.reference import multi_hot
from tests.backend_utils import POLICIES
from tests.backend_utils import BACKEND, dtype_name, to_numpy, value_and_grads, value_and_grads_tensors
from tests.backend_utils import assert_within_low_precision, dtype_policy, loss_scale
from tests.cutbce.kernel_inputs import dense_under_policy, policy_inputs

IMPLEMENTATIONS = ["reference", "chunked"]


def make_case(rng, lead, dim, vocab, labels, *, bias=True, scale=1.0):
    hidden = (rng.normal(size=lead + (dim,)) * scale / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    ids = rng.integers(-2, vocab + 3, size=lead + (labels,)).astype("int32")
    if labels >= 2:  # a duplicate in every case
        ids[..., 1] = ids[..., 0]
    b = rng.normal(size=(vocab,)).astype("float32") if bias else None
    cot = rng.uniform(-2.0, 2.0, size=lead).astype("float32")
    return hidden, table, ids, b, cot


def keras_dense_loss(hidden, table, ids, bias, label_smoothing=0.0):
    """Per-position loss by Keras's own binary_crossentropy on the dense logits."""
    d = ops.shape(hidden)[-1]
    lead = ops.shape(hidden)[:-1]
    flat = ops.reshape(hidden, (-1, d))
    logits = ops.matmul(ops.cast(flat, "float32"), ops.transpose(ops.cast(table, "float32")))
    if bias is not None:
        logits = logits + ops.cast(bias, "float32")
    flat_ids = ops.reshape(ids, (ops.shape(flat)[0], ops.shape(ids)[-1]))
    targets = multi_hot(flat_ids, ops.shape(table)[0])
    loss = keras.losses.binary_crossentropy(
        targets, logits, from_logits=True, label_smoothing=label_smoothing
    )
    return ops.reshape(loss, lead)


def weighted_sum(loss_fn, cot):
    cot_t = ops.convert_to_tensor(cot)
    return lambda *args: ops.sum(ops.cast(loss_fn(*args), "float32") * cot_t)


def check_against_keras(impl, hidden, table, ids, bias, cot, *, label_smoothing=0.0, chunk_size=None, rtol=2e-5, atol=2e-6):
    def cut(h, t, *b):
        return cut_binary_crossentropy(
            h, t, ids, b[0] if b else None, label_smoothing=label_smoothing,
            chunk_size=chunk_size, implementation=impl,
        )

    def dense(h, t, *b):
        return keras_dense_loss(h, t, ids, b[0] if b else None, label_smoothing)

    args = (hidden, table) + ((bias,) if bias is not None else ())
    per_pos = to_numpy(cut(*[ops.convert_to_tensor(a) for a in args]))
    per_pos_dense = to_numpy(dense(*[ops.convert_to_tensor(a) for a in args]))
    assert per_pos.shape == hidden.shape[:-1]
    np.testing.assert_allclose(per_pos, per_pos_dense, rtol=rtol, atol=atol)
    value, grads = value_and_grads(weighted_sum(cut, cot), *args)
    value_d, grads_d = value_and_grads(weighted_sum(dense, cot), *args)
    np.testing.assert_allclose(value, value_d, rtol=rtol, atol=atol)
    for name, g, gd in zip(("hidden", "table", "bias"), grads, grads_d):
        np.testing.assert_allclose(g, gd, rtol=1e-4, atol=1e-6, err_msg=f"grad {name}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.slow
def test_random_shapes_match_keras_bce(impl, seed):
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(1, 3))
    lead = tuple(int(x) for x in rng.integers(1, 9, size=rank))
    dim = int(rng.integers(1, 24))
    vocab = int(rng.integers(1, 700))
    labels = int(rng.integers(1, 6))
    chunk = int(rng.choice([1, 7, 128, 256, 1024]))
    case = make_case(rng, lead, dim, vocab, labels, bias=bool(seed % 2))
    smoothing = float(rng.choice([0.0, 0.1]))
    check_against_keras(impl, *case, label_smoothing=smoothing, chunk_size=chunk)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "vocab,chunk", [(300, 128), (100, 128), (256, 128), (1, 128), (513, None)]
)
@pytest.mark.slow
def test_vocab_not_multiple_of_tile(impl, vocab, chunk):
    case = make_case(np.random.default_rng(vocab), (5, 3), 16, vocab, 4)
    check_against_keras(impl, *case, chunk_size=chunk)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_single_label_and_empty_targets(impl):
    rng = np.random.default_rng(1)
    hidden, table, ids, bias, cot = make_case(rng, (6,), 8, 50, 1)
    check_against_keras(impl, hidden, table, ids, bias, cot, chunk_size=16)
    empty = np.zeros((6, 0), "int32")
    check_against_keras(impl, hidden, table, empty, bias, cot, chunk_size=16)
    # One id per position may also be given without the trailing L axis.
    a = to_numpy(cut_binary_crossentropy(hidden, table, ids[:, 0], bias, implementation=impl))
    b = to_numpy(cut_binary_crossentropy(hidden, table, ids, bias, implementation=impl))
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_padding_and_duplicates_are_ignored(impl):
    rng = np.random.default_rng(2)
    hidden, table, _, bias, _ = make_case(rng, (4,), 8, 40, 1)
    clean = np.array([[3, -1, -1, -1], [0, 39, -1, -1], [5, -1, -1, -1], [-1, -1, -1, -1]], "int32")
    noisy = np.array([[3, 3, 40, -7], [39, 0, 0, 1000], [5, 5, 5, 5], [40, 41, -1, -2]], "int32")
    a = to_numpy(cut_binary_crossentropy(hidden, table, clean, bias, chunk_size=16, implementation=impl))
    b = to_numpy(cut_binary_crossentropy(hidden, table, noisy, bias, chunk_size=16, implementation=impl))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def numpy_loss(hidden, table, ids, bias, label_smoothing, pos_weight):
    z = hidden.astype(np.float64) @ table.astype(np.float64).T
    if bias is not None:
        z = z + bias
    v = table.shape[0]
    y = np.zeros_like(z)
    for r, row in enumerate(ids.reshape(-1, ids.shape[-1])):
        for i in row:
            if 0 <= i < v:
                y[r, i] = 1.0
    y = y * (1 - label_smoothing) + label_smoothing / 2
    softplus = np.logaddexp(0.0, z)
    return np.mean((1 + (pos_weight - 1) * y) * softplus - pos_weight * y * z, axis=-1)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("smoothing,pos_weight", [(0.0, 3.0), (0.2, 0.5), (1.0, 2.0)])
def test_pos_weight_and_label_smoothing(impl, smoothing, pos_weight):
    rng = np.random.default_rng(3)
    hidden, table, ids, bias, cot = make_case(rng, (7,), 8, 200, 3)
    out = to_numpy(cut_binary_crossentropy(
        hidden, table, ids, bias, label_smoothing=smoothing, pos_weight=pos_weight,
        chunk_size=64, implementation=impl))
    np.testing.assert_allclose(out, numpy_loss(hidden, table, ids, bias, smoothing, pos_weight), rtol=2e-5)

    def fn(h, t, b, implementation):
        return cut_binary_crossentropy(h, t, ids, b, label_smoothing=smoothing,
                                       pos_weight=pos_weight, chunk_size=64,
                                       implementation=implementation)

    _, grads = value_and_grads(weighted_sum(lambda h, t, b: fn(h, t, b, impl), cot), hidden, table, bias)
    _, ref = value_and_grads(weighted_sum(lambda h, t, b: fn(h, t, b, "reference"), cot), hidden, table, bias)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_huge_logits_are_finite_and_exact(impl):
    rng = np.random.default_rng(4)
    hidden, table, ids, bias, cot = make_case(rng, (6,), 4, 90, 3, scale=400.0)
    z = hidden @ table.T + bias
    assert np.abs(z).max() > 150
    out = to_numpy(cut_binary_crossentropy(hidden, table, ids, bias, chunk_size=32, implementation=impl))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, numpy_loss(hidden, table, ids, bias, 0.0, 1.0), rtol=1e-5)
    _, grads = value_and_grads(
        weighted_sum(lambda h, t, b: cut_binary_crossentropy(h, t, ids, b, chunk_size=32, implementation=impl), cot),
        hidden, table, bias)
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("op", ["bce", "softmax"])
def test_float64_inputs_give_a_float32_loss(op):
    """The public ops and losses return float32 for float64 inputs on every backend (on JAX
    without x64, the default, the inputs are float32 already); torch's chunked kernel computes
    and returns float64 (the registry's contract, `test_torch_chunked.py`)."""
    from keras_cutbce import CutSoftmaxLoss, cut_categorical_crossentropy

    rng = np.random.default_rng(10)
    hidden, table, ids, bias, _ = make_case(rng, (4,), 3, 7, 2)
    hidden, table, bias = (ops.convert_to_tensor(x, "float64") for x in (hidden, table, bias))
    fn, loss = ((cut_binary_crossentropy, CutBCELoss) if op == "bce"
                else (cut_categorical_crossentropy, CutSoftmaxLoss))
    for implementation in ("chunked", "reference"):
        per_row = fn(hidden, table, ids, bias, implementation=implementation)
        assert dtype_name(per_row) == "float32", implementation
    reduced = loss(table, bias, reduction="none")(ids, hidden)
    assert dtype_name(reduced) == "float32"


def test_items_with_a_bias_of_minus_inf_without_label_smoothing():
    """A `-inf` bias masks an item (term 0, no gradient), a masked target gives `+inf`, and a
    padding id that falls on a masked item adds nothing. (Keras's dense BCE, and the dense
    reference, give NaN at any `-inf` logit; with label smoothing the contract leaves it open.)"""
    rng = np.random.default_rng(9)
    hidden, table, _, bias, cot = make_case(rng, (5,), 8, 40, 1)
    bias[:8] = -np.inf
    ids = np.array([[9, -1], [0, -1], [-1, -1], [12, 12], [20, 50]], "int32")  # row 1: masked target

    def fn(h, t, b):
        return cut_binary_crossentropy(h, t, ids, b, chunk_size=16, implementation="chunked")

    z = hidden.astype(np.float64) @ table.astype(np.float64).T + bias
    y = to_numpy(multi_hot(ids, 40)).astype(bool)
    want = np.mean(np.logaddexp(0.0, z) - np.where(y, z, 0.0), axis=-1)
    assert np.isposinf(want[1]) and np.isfinite(np.delete(want, 1)).all()
    np.testing.assert_allclose(to_numpy(fn(hidden, table, bias)), want, rtol=1e-5)
    cot[1] = 0.0
    _, grads = value_and_grads(weighted_sum(fn, cot), hidden, table, bias)
    slopes = (1.0 / (1.0 + np.exp(-z)) - y) * cot[:, None] / 40
    for name, got, w in zip(("hidden", "table", "bias"),
                            grads, (slopes @ table, slopes.T @ hidden, slopes.sum(0))):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.slow
def test_low_precision_inputs(impl, dtype):
    rng = np.random.default_rng(5)
    hidden, table, ids, bias, cot = make_case(rng, (3, 5), 16, 300, 4)
    low = [ops.cast(x, dtype) for x in (hidden, table, bias)]
    rounded = [to_numpy(x).astype("float32") for x in low]

    def loss_fn(h, t, b):
        return cut_binary_crossentropy(h, t, ids, b, chunk_size=128, implementation=impl)

    value, grads = value_and_grads_tensors(weighted_sum(loss_fn, cot), *low)
    assert dtype_name(loss_fn(*low)) == "float32"
    for g in grads:
        assert dtype_name(g) == dtype
    value32, grads32 = value_and_grads(weighted_sum(loss_fn, cot), *rounded)
    np.testing.assert_allclose(to_numpy(value), value32, rtol=1e-4)
    for g, g32 in zip(grads, grads32):
        np.testing.assert_allclose(to_numpy(g), g32, rtol=0.05, atol=0.02 * np.abs(g32).max())


POLICY_CASES = [
    pytest.param(policy, impl, id=f"{policy}-{impl}", marks=pytest.mark.slow if impl == "pallas" else ())
    for policy in POLICIES for impl in IMPLEMENTATIONS + (["pallas"] if BACKEND == "jax" else [])
]


@pytest.mark.parametrize("policy,impl", POLICY_CASES)
def test_every_policy_is_as_exact_as_the_dense_model_under_it(policy, impl):
    """The mixed precision matrix of the op and the loss (each implementation on this backend).

    Under each policy the loss gets what a Keras model hands it: hidden states in
    the compute dtype, the float32 table and bias (variables); under
    `mixed_float16` a loss-scaled cotangent (the per-row op) or upstream
    gradient (`CutBCELoss`, the fused weighted sum, scaled after its pass).
    Loss and gradients against float64 on the same values, each row (a table
    gradient row: an item) no worse than twice the dense Keras model under the
    policy (`dense_under_policy`): the tolerance is that model's own error.
    """
    from tests.cutbce.test_chunked import truth

    hidden, table, bias, ids, weights = policy_inputs(np.random.default_rng(31))
    scale = loss_scale(policy)
    with dtype_policy(policy) as compute:
        hidden = ops.cast(hidden, compute)
        exact = to_numpy(hidden)  # the values the loss gets
        dense = dense_under_policy(compute)

        def per_row(h, t, b):
            return cut_binary_crossentropy(h, t, ids, b, chunk_size=128, implementation=impl)

        def fused(h, t, b):
            return CutBCELoss(t, b, chunk_size=128, implementation=impl)(ids, h)

        cases = (  # name, ours, the dense model's, row weights of the float64 truth
            ("per-row", weighted_sum(per_row, weights * scale),
             weighted_sum(lambda h, t, b: dense(h, t, ids, b), weights * scale), weights * scale),
            ("fused", lambda h, t, b: fused(h, t, b) * scale,
             lambda h, t, b: ops.mean(dense(h, t, ids, b)) * scale,
             np.full(len(exact), scale / len(exact))),
        )
        losses = to_numpy(per_row(hidden, table, bias))
        low_losses = to_numpy(dense(hidden, table, ids, bias))
        for name, ours, theirs, rows in cases:
            value, grads = value_and_grads(ours, hidden, table, bias)
            low_value, low_grads = value_and_grads(theirs, hidden, table, bias)
            true_losses, true_grads = truth(exact, table, ids, bias, rows)
            assert_within_low_precision(value, low_value, np.sum(rows * true_losses), f"{name} value")
            for what, got, low, want in zip(("hidden", "table", "bias"), grads, low_grads, true_grads):
                assert_within_low_precision(got, low, want, f"{name} d {what}")
    assert_within_low_precision(losses, low_losses, truth(exact, table, ids, bias, weights)[0], "loss")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradient_is_exact_for_any_cotangent(impl):
    """reduction='none' then arbitrary per-position weights: the fused-loss bug class."""
    rng = np.random.default_rng(6)
    hidden, table, ids, bias, _ = make_case(rng, (4, 6), 8, 333, 5)
    for cot in (rng.normal(size=(4, 6)), np.zeros((4, 6)), np.eye(4, 6) * 7.0):
        check_against_keras(impl, hidden, table, ids, bias, cot.astype("float32"), chunk_size=100)


def test_table_as_variable_and_layer():
    rng = np.random.default_rng(7)
    hidden, table, ids, bias, _ = make_case(rng, (2, 3), 8, 20, 2)
    layer = keras.layers.Embedding(20, 8)
    layer.build((None,))
    layer.embeddings.assign(table)
    variable = keras.Variable(table)
    expected = to_numpy(cut_binary_crossentropy(hidden, table, ids))
    for source in (layer, variable):
        np.testing.assert_allclose(to_numpy(cut_binary_crossentropy(hidden, source, ids)), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(hidden=np.zeros((8,), "float32")), ValueError, ["hidden", "rank"]),
        (dict(hidden=np.zeros((2, 5), "float32")), ValueError, ["hidden", "D", "(2, 5)"]),
        (dict(ids=np.zeros((2, 1), "bool")), TypeError, ["target_ids", "integer", "bool"]),
        (dict(ids=np.full((2, 1), 0.5, "float32")), ValueError, ["target_ids", "whole-number", "0.5"]),
        (dict(ids=np.zeros((3, 1), "int32")), ValueError, ["target_ids", "(3, 1)"]),
        (dict(bias=np.zeros((9,), "float32")), ValueError, ["bias", "[10]", "(9,)"]),
        (dict(implementation="fast"), ValueError, ["implementation", "'fast'"]),
        (dict(chunk_size=0), ValueError, ["chunk_size"]),
        (dict(label_smoothing=1.5), ValueError, ["label_smoothing"]),
        (dict(pos_weight=0.0), ValueError, ["pos_weight"]),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, error, words):
    args = dict(hidden=np.zeros((2, 4), "float32"), table=np.zeros((10, 4), "float32"),
                ids=np.zeros((2, 1), "int32"), bias=None)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in args}
    args.update(kwargs)
    with pytest.raises(error) as info:
        cut_binary_crossentropy(args["hidden"], args["table"], args["ids"], args["bias"], **options)
    for word in words:
        assert word in str(info.value)


def test_pallas_is_refused_off_jax():
    if BACKEND == "jax":
        pytest.skip("pallas is available on jax")
    with pytest.raises(ValueError, match="JAX"):
        cut_binary_crossentropy(np.zeros((2, 4), "float32"), np.zeros((10, 4), "float32"),
                                np.zeros((2, 1), "int32"), implementation="pallas")


def test_dispatch_table_runs_the_named_implementation(monkeypatch):
    """`implementation=` picks the kernel module of the dispatch table; "reference" never runs a kernel."""
    import importlib

    from keras_cutbce import ops as cut_ops

    chunked = importlib.import_module(f"keras_cutbce.backends.{BACKEND}.chunked")
    calls = []
    for name in ("cut_bce", "cut_bce_weighted_sum"):
        original = getattr(chunked, name, None)
        if original is None:
            continue

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(chunked, name, spy)
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(4, 3)).astype("float32")
    table = rng.normal(size=(9, 3)).astype("float32")
    ids = rng.integers(-1, 9, size=(4, 2))
    weights = np.full((4,), 0.25, "float32")
    ref = cut_ops.weighted_loss_sum(hidden, table, ids, weights, implementation="reference")
    cut_ops.cut_binary_crossentropy(hidden, table, ids, implementation="reference")
    assert calls == []
    got = cut_ops.weighted_loss_sum(hidden, table, ids, weights, implementation="chunked")
    assert calls and set(calls) <= {"cut_bce", "cut_bce_weighted_sum"}
    np.testing.assert_allclose(to_numpy(got), to_numpy(ref), rtol=1e-5)


def _default_tile(hidden, table, family="bce"):
    """The tile `chunk_size=None` gives the chunked loop for these inputs (the registry's platform)."""
    from keras_cutbce import registry
    from keras_cutbce.math.tiling import default_tile

    rows, dim = hidden.shape
    return default_tile(BACKEND, registry._platform(hidden), rows, table.shape[0], dim, family)


@pytest.mark.parametrize("rows, vocab, torch_tile, other_tile, torch_softmax", [
    (5120, 10**6, 3072, 128, 3072), (1280, 10**6, 12416, 768, 12416), (160, 10**6, 65536, 6528, 31360),
    (160, 10**5, 52352, 6528, 6528), (160, 1000, 1024, 1024, 1024), (640, 10**6, 24960, 1536, 24960),
    (4096, 32768, 2048, 256, 1024),
])
def test_default_tile_on_cpu_follows_the_backends_rule(rows, vocab, torch_tile, other_tile, torch_softmax):
    """`chunk_size=None` on CPU: torch budgets the table gradient (V x D x 4 bytes, D = 64 here); torch's
    softmax takes the cache's tile widened to at most 32 tiles (the cache's alone made 651 at 10^6 items,
    640 rows: a dozen thread barriers each), within BCE's."""
    from keras_cutbce import registry

    hidden = ops.zeros((rows, 64))
    if registry._platform(hidden) != "cpu":
        pytest.skip("the CPU rule")
    table = np.broadcast_to(np.float32(0), (vocab, 64))  # no memory: only its shape is read
    want = torch_tile if BACKEND == "torch" else other_tile
    assert _default_tile(hidden, table) == want
    softmax = torch_softmax if BACKEND == "torch" else other_tile
    assert _default_tile(hidden, table, "softmax") == softmax


@pytest.mark.parametrize("rows, vocab, tile", [
    (16384, 876_000, 4096), (4096, 100_000, 16384), (2048, 10**6, 32768), (128, 10**6, 65536),
    (16384, 1000, 1024), (10**6, 10**6, 128),
])
def test_default_tile_on_a_cuda_gpu_is_not_launch_bound(rows, vocab, tile, monkeypatch):
    """torch on CUDA: 1 GiB of `[M, T]` buffers (16 bytes a logit), not the 64 MiB that left 256-column tiles
    at 16384 rows (about ten launches a tile); the other backends' GPU rule is unchanged."""
    from keras_cutbce import registry

    monkeypatch.setattr(registry, "_platform", lambda tensor: "gpu")
    table = np.broadcast_to(np.float32(0), (vocab, 64))
    want = tile if BACKEND == "torch" else min(max(64 * 2**20 // (16 * rows) // 128 * 128, 128), 8192,
                                               -(-vocab // 128) * 128)
    assert _default_tile(ops.zeros((rows, 64)), table) == want


def test_registry_entries_of_this_backend_resolve_to_functions():
    """Every path in the registry for the active backend names a function that exists."""
    from keras_cutbce import registry

    for op, implementations in registry.IMPLEMENTATIONS.items():
        for implementation in implementations:
            if registry.has(op, implementation, BACKEND):
                assert callable(registry.get(op, implementation, BACKEND)), (op, implementation)


def test_registry_has_no_silent_fallbacks():
    """A missing (op, implementation) raises; the fused sum has no sharded entry."""
    from keras_cutbce import registry

    assert not registry.has("cut_bce_weighted_sum", "sharded", "jax")
    assert not registry.has("cut_bce_weighted_sum", "reference", BACKEND)
    with pytest.raises(NotImplementedError, match="pallas"):
        registry.get("cut_bce", "pallas", "torch")


def test_auto_tries_the_device_order():
    from keras_cutbce import registry

    assert registry.auto("cut_bce", "jax", "tpu") == "pallas"
    assert registry.auto("top_k", "jax", "tpu") == "chunked"  # no Pallas top-k: the next in order
    assert registry.auto("cut_bce", "torch", "tpu") == "chunked"
    assert registry.auto("cut_bce", "tensorflow", "gpu") == "chunked"


def test_the_loss_checks_its_scalar_options_at_construction_only(monkeypatch):
    """`CutBCELoss` checks label_smoothing, pos_weight, chunk_size, implementation once."""
    from keras_cutbce import CutBCELoss, checks

    calls = []
    original = checks.loss_options

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(checks, "loss_options", counted)
    rng = np.random.default_rng(3)
    hidden, table, ids, bias, _ = make_case(rng, (2, 3), 4, 20, 2)
    loss = CutBCELoss(keras.Variable(table), keras.Variable(bias), label_smoothing=0.1)
    assert len(calls) == 1
    for _ in range(2):
        loss(ids, hidden)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="label_smoothing"):
        loss.label_smoothing = 1.5  # an assignment is checked too
    assert loss.label_smoothing == 0.1


def test_item_table_reads_a_layer_once_into_value_variable_and_sharding():
    from keras_cutbce.item_table import ItemTable

    layer = keras.layers.Embedding(7, 3)
    layer.build((None,))
    table = ItemTable.read(layer)
    assert table.variable is layer.embeddings and table.source is layer
    assert table.vocab_size == 7 and table.sharding is None
    np.testing.assert_array_equal(to_numpy(table.value), to_numpy(layer.embeddings))
    assert ItemTable.read(table) is table
    constant = ItemTable.read(np.zeros((5, 3), "float32"))
    assert constant.variable is None and constant.trainable_variables() == []
    with pytest.raises(TypeError, match="not built"):
        ItemTable.read(keras.layers.Embedding(7, 3))
