"""A table split over torch.distributed ranks (`ItemEmbedding(vocab_parallel=True)`) gives one process's numbers.

Gloo ranks on CPU, each a spawned process (`keras_erase.torch.launch.run_local`);
R = 3 does not divide V = 31. One process on the concatenated positions is
the spec: relative error <= 1e-5 for the losses, the hidden, table and bias
gradients and the lookups.
"""

import keras
import numpy as np
import pytest

from tests.cutbce import vocab_parallel_ranks as ranks

torch_only = pytest.mark.skipif(keras.backend.backend() != "torch",
                                reason="torch.distributed ranks run on the torch backend")

CASES = [
    ("bce", {}),
    ("bce", {"label_smoothing": 0.1, "pos_weight": 2.0, "chunk_size": 4}),
    ("softmax", {}),
    ("softmax", {"label_smoothing": 0.1, "chunk_size": 4}),
]


def _close(got, want, what):
    scale = max(float(np.max(np.abs(want))), 1e-30)
    error = float(np.max(np.abs(got - want))) / scale
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


def _one_process(data, family, options):
    import torch

    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce import cut_categorical_crossentropy

    inputs = [torch.tensor(data[k], requires_grad=True) for k in ("hidden", "table", "bias")]
    op = cut_binary_crossentropy if family == "bce" else cut_categorical_crossentropy
    loss = op(inputs[0], inputs[1], data["ids"], inputs[2], **options)
    grads = torch.autograd.grad((loss * torch.tensor(data["cotangent"])).sum(), inputs)
    return [loss.detach().numpy()] + [g.numpy() for g in grads]


@torch_only
@pytest.mark.slow
@pytest.mark.parametrize("world, rows", [(2, 5), (3, (4, 2, 5))])
def test_losses_and_gradients_match_one_process(world, rows):
    from keras_erase.torch.launch import run_local

    data = ranks.case(0, 31, 8, rows, 4, world)
    per_rank = run_local(ranks.op_gradients, world, args=(data, CASES), threads_per_rank=1)
    for index, (family, options) in enumerate(CASES):
        want = _one_process(data, family, options)
        for part, name in enumerate(("loss", "hidden gradient", "table gradient", "bias gradient")):
            got = np.concatenate([result[index][part] for result in per_rank])
            _close(got, want[part], f"R={world} {family} {options} {name}")


@torch_only
@pytest.mark.slow
def test_lookup_matches_one_process_and_sends_gradients_to_the_owner():
    from keras_erase.torch.launch import run_local

    data = ranks.case(1, 31, 8, (3, 4, 2), 4, 3)
    per_rank = run_local(ranks.lookups, 3, args=(data,), threads_per_rank=1)
    ids = np.clip(data["ids"], 0, 30)
    np.testing.assert_array_equal(np.concatenate([r[0] for r in per_rank]), data["table"][ids])
    want = np.zeros_like(data["table"])
    np.add.at(want, ids, np.broadcast_to(data["hidden"][:, None, :], ids.shape + (8,)))
    _close(np.concatenate([r[1] for r in per_rank]), want, "table gradient of the lookup")


@torch_only
def test_vocab_parallel_without_a_process_group_says_how_to_start_one():
    from keras_cutbce import ItemEmbedding

    with pytest.raises(RuntimeError, match="init_process_group"):
        ItemEmbedding(10, 4, vocab_parallel=True)


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="the refusal on the other backends")
def test_vocab_parallel_elsewhere_is_refused_naming_the_way():
    from keras_cutbce import ItemEmbedding

    way = "ModelParallel" if keras.backend.backend() == "jax" else "torch backend"
    with pytest.raises(ValueError, match=way):
        ItemEmbedding(10, 4, vocab_parallel=True)


def test_process_group_needs_vocab_parallel():
    from keras_cutbce import ItemEmbedding

    with pytest.raises(ValueError, match="process_group"):
        ItemEmbedding(10, 4, process_group=object())


@torch_only
@pytest.mark.slow
def test_retrieval_ops_and_metrics_match_one_process():
    from keras_cutbce import ItemEmbedding
    from keras_erase.torch.launch import run_local

    data = ranks.case(2, 31, 8, (4, 2, 5), 3, 3)
    per_rank = run_local(ranks.retrieval, 3, args=(data,), threads_per_rank=1)
    layer = ItemEmbedding(31, 8, use_bias=True)
    layer.build()
    layer.embeddings.assign(data["table"])
    layer.bias.assign(data["bias"])
    want = ranks.retrieval(0, 1, data, table=layer)
    for part, name in enumerate(("top-k scores", "top-k ids", "ranks", "counts")):
        got = np.concatenate([result[part] for result in per_rank])
        np.testing.assert_allclose(got, want[part], rtol=1e-6, err_msg=name)
    for part in range(4, 7):
        for result in per_rank:  # every rank holds the global values
            assert result[part].keys() == want[part].keys()
            for key, value in want[part].items():
                np.testing.assert_allclose(result[part][key], value, rtol=1e-5, err_msg=key)


def _initial(vocab, dim):
    rng = np.random.default_rng(0)
    return {
        "items/embeddings": 0.3 * rng.normal(size=(vocab, dim)).astype("float32"),
        "items/bias": 0.1 * rng.normal(size=(vocab,)).astype("float32"),
        "dense/kernel": 0.3 * rng.normal(size=(dim, dim)).astype("float32"),
        "dense/bias": np.zeros(dim, "float32"),
    }


@torch_only
@pytest.mark.slow
@pytest.mark.parametrize("world, optimizer, policy, family", [
    (2, "SGD", "float32", "bce"),
    (3, "Adam", "float32", "softmax"),
    (2, "Adam", "mixed_bfloat16", "bce"),
])
def test_fit_on_ranks_trains_like_one_process_on_the_global_batch(world, optimizer, policy, family):
    """4 steps of `EraseModel.fit` (the standard step under the process group) with a tied split table.

    SGD shows a factor R on the shard's gradient; float32: the updates agree to 1e-5 of their size.
    mixed_bfloat16: the hidden gradient is summed over ranks in another order, then rounded to
    bfloat16 as in one process, so an element may round the other way (2^-8): within 2^-7.
    """
    from keras_erase.torch.launch import run_local

    initial = _initial(31, 8)
    x, y = ranks.training_data(1, 31, 4, world, 3)
    import keras

    try:
        want, _ = ranks.train(0, 1, x, y, initial, family, optimizer, policy, split=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    per_rank = run_local(ranks.train, world, args=(x, y, initial, family, optimizer, policy),
                         threads_per_rank=1)
    bound = 1e-5 if policy == "float32" else 2.0**-7
    for rank, (weights, _) in enumerate(per_rank):
        for path, value in want.items():
            update = float(np.max(np.abs(value - initial[path])))
            assert update > 0, path
            error = float(np.max(np.abs(weights[path] - value))) / update
            assert error <= bound, f"rank {rank} {path}: {error:.2e} of the update"


@torch_only
@pytest.mark.slow
def test_users_model_on_two_ranks_steps_as_exactly_as_one_process():
    """`test_loss.users_model` (the split `ItemEmbedding` shared by two `DetachBlock` towers with
    their own `CutSoftmaxLoss`, a reused block, batch norm, dropout, an L2 kernel regularizer), one
    SGD step of `fit` on 2 gloo ranks (each the same batch) under float32, mixed_bfloat16 and
    mixed_float16 (Keras's loss scaling across ranks), against one process's float64 step: no
    worse than twice the dense Keras model under the policy (`test_loss.assert_step_like_dense`).
    float32: also one process's `CutSoftmaxLoss` step, each weight's change within 1e-4 of its
    float64 move (the ranks merge the softmax statistics in another order; measured: 2.5e-5 for
    `tower_b`'s head kernel behind batch norm, <= 6e-7 for every other weight)."""
    from keras_erase.torch.launch import run_local
    from tests.cutbce.test_loss import assert_step_like_dense, first_step, fit_data

    policies = ("float32", "mixed_bfloat16", "mixed_float16")
    per_rank = run_local(ranks.users_model_steps, 2, args=(policies,), threads_per_rank=1)
    x, y = fit_data(53)
    true = first_step(53, 8, x, y, "float64", softmax=True, users=True)
    one_loss, one_changes = first_step(53, 8, x, y, "float32", softmax=True, users=True)
    for index, policy in enumerate(policies):
        dense = first_step(53, 8, x, y, policy, dense=True, softmax=True, users=True)
        for result in per_rank:
            assert_step_like_dense(result[index], dense, true, whole_model=policy != "float32")
            if policy == "float32":
                np.testing.assert_allclose(result[index][0], one_loss, rtol=1e-6)
                for i, (got, want, move) in enumerate(zip(result[index][1], one_changes, true[1])):
                    error = np.abs(got - want).max() / np.abs(move).max()
                    assert error <= 1e-4, f"weight #{i}: {error:.2e} of its float64 move"


@torch_only
@pytest.mark.slow
def test_sampled_softmax_on_a_split_table_names_the_losses_that_run():
    from keras_erase.torch.launch import run_local

    for message in run_local(ranks.sampled_on_split_table, 2, threads_per_rank=1):
        assert message is not None and "CutSoftmaxLoss" in message and "vocab_parallel=False" in message


@torch_only
@pytest.mark.slow
def test_saved_under_two_ranks_loads_under_three_and_in_one_process(tmp_path):
    from keras_erase.torch.launch import run_local

    data = ranks.case(3, 31, 8, 2, 2, 2)
    saved = run_local(ranks.saved_and_loaded, 2, args=(data, str(tmp_path), True), threads_per_rank=1)
    for (whole, rows), held in zip(saved, (16, 15)):  # S = ceil(31 / 2)
        np.testing.assert_array_equal(whole[0], data["table"])
        assert rows[0].shape == (held, 8)
    loaded = run_local(ranks.saved_and_loaded, 3, args=(data, str(tmp_path), False), threads_per_rank=1)
    for rank, (whole, rows) in enumerate(loaded):
        np.testing.assert_array_equal(whole[0], data["table"])
        np.testing.assert_array_equal(whole[1], data["bias"])
        np.testing.assert_array_equal(rows[0], data["table"][rank * 11:(rank + 1) * 11])
    whole, rows = ranks.saved_and_loaded(0, 1, data, str(tmp_path), False)
    assert rows is None  # no process group here: the whole table
    np.testing.assert_array_equal(whole[0], data["table"])
    np.testing.assert_array_equal(whole[1], data["bias"])


@torch_only
@pytest.mark.slow
def test_loss_classes_with_sample_weights_match_one_process():
    """`reduction="sum"`: the ranks' losses add up to one process's; weights of 0 drop positions."""
    from keras_erase.torch.launch import run_local

    data = ranks.case(4, 31, 8, (3, 5), 4, 2)
    per_rank = run_local(ranks.loss_class_gradients, 2, args=(data,), threads_per_rank=1)
    want = ranks.loss_class_gradients(0, 1, data, split=False)
    for index, name in enumerate(("CutBCELoss", "CutSoftmaxLoss")):
        _close(sum(r[index][0] for r in per_rank), want[index][0], f"{name} value")
        for part, what in ((1, "hidden"), (2, "table"), (3, "bias")):
            got = np.concatenate([r[index][part] for r in per_rank])
            _close(got, want[index][part], f"{name} {what} gradient")


@torch_only
@pytest.mark.slow
def test_triton_kernels_on_a_shard_match_one_process(monkeypatch):
    """`implementation="triton"` (what `"auto"` runs on CUDA) for BCE: the fused kernels on each shard,
    here in the Triton interpreter on CPU (set before the ranks import Triton)."""
    pytest.importorskip("triton")
    from keras_erase.torch.launch import run_local

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = [("bce", {"implementation": "triton"}),
             ("bce", {"implementation": "triton", "label_smoothing": 0.1, "pos_weight": 2.0})]
    data = ranks.case(5, 31, 8, (4, 2, 5), 4, 3)
    per_rank = run_local(ranks.op_gradients, 3, args=(data, cases), threads_per_rank=1)
    for index, (family, options) in enumerate(cases):
        options = {k: v for k, v in options.items() if k != "implementation"}
        want = _one_process(data, family, options)
        for part, name in enumerate(("loss", "hidden gradient", "table gradient", "bias gradient")):
            got = np.concatenate([result[index][part] for result in per_rank])
            _close(got, want[part], f"triton {options} {name}")


def _cuda_devices():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@torch_only
@pytest.mark.slow
def test_nccl_ranks_match_one_process():
    """NCCL, rank r on cuda:r (reduce_scatter for the hidden gradient; BCE on the Triton kernels)."""
    if _cuda_devices() < 2:
        pytest.skip(f"NCCL ranks need 2 CUDA GPUs; {_cuda_devices()} present")
    from keras_erase.torch.launch import run_local

    data = ranks.case(6, 31, 8, (4, 5), 4, 2)
    per_rank = run_local(ranks.op_gradients, 2, args=(data, CASES), backend="nccl")
    for index, (family, options) in enumerate(CASES):
        want = _one_process(data, family, {**options, "implementation": "chunked"})
        for part, name in enumerate(("loss", "hidden gradient", "table gradient", "bias gradient")):
            got = np.concatenate([result[index][part] for result in per_rank])
            _close(got, want[part], f"NCCL {family} {options} {name}")
