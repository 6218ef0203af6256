"""EraseModel under torch.distributed (gloo, 2 CPU processes on 127.0.0.1).

Two ranks, each on its half of every batch, must end with the same weights as one
process on the full batches (mean-reduced main and local losses, SGD), for the
"standard", "blocking", "threaded" and "auto" dispatches with detached block
inputs, and "blocking"/"threaded" with non-detached ones. Every tower carries weight
and activity regularizers (its own losses, reduced with its early backward) and
so does a layer outside the towers. Rank 1 starts from
different weights: the broadcast from rank 0 at the start of `fit` must fix them. The ranks also report the order
in which they launched their gradient all-reduces (block order, then the rest).

The ranks are spawned by `keras_erase.torch.launch.run_local` (gloo on 127.0.0.1, one
torch thread each, a timeout so that nothing hangs).
"""

import os

import numpy as np
import pytest

# (dispatch, detach_input): every schedule with detached inputs; the early
# schedules also with non-detached inputs (local losses reach the shared stem).
CASES = (
    ("standard", True),
    ("blocking", True),
    ("threaded", True),
    ("auto", True),
    ("blocking", False),
    ("threaded", False),
)
DETACH = (True, False)
N, BATCH, EPOCHS, TOWERS = 64, 32, 4, 3  # 2 steps per epoch: K = 8 steps
LR = 0.5


def _backend():
    from tests.backend_utils import BACKEND

    return BACKEND


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_backend() != "torch", reason="torch.distributed test")]


def _shard(array, rank, world):
    """Rank `rank`'s rows of every full batch of `BATCH` rows (same split as the global batch)."""
    per = BATCH // world
    rows = [np.arange(start + rank * per, start + (rank + 1) * per) for start in range(0, N, BATCH)]
    return array[np.concatenate(rows)]


def _train(dispatch, detach_input, x, y, batch_size, initial=None, seed=0):
    import keras

    from tests.erase.test_erase import build_ctr

    model = build_ctr(
        dispatch,
        num_towers=TOWERS,
        detach_input=detach_input,
        seed=seed,
        auto_steps=1,
        intra_op_threads=None,
        regularized=True,  # block regularizers and add_loss: part of the early backward
    )
    if initial is not None:
        model.set_weights(initial)
    model.compile(keras.optimizers.SGD(LR), keras.losses.BinaryCrossentropy())
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def _rank_main(rank, world, workdir):
    """One rank (process group initialized by `run_local`): trains every case on its shard."""
    from tests.backend_utils import to_numpy
    from tests.erase.test_erase import ctr_data

    x, y = ctr_data(N)
    x, y = _shard(x, rank, world), _shard(y, rank, world)
    results, report = {}, {}
    for detach_input in DETACH:
        initial = np.load(os.path.join(workdir, f"initial_{detach_input}.npz"))
        initial = [initial[f"w{i}"] for i in range(len(initial.files))]
        for mode in [m for m, d in CASES if d == detach_input]:
            # Rank 0 starts from the saved weights, rank 1 from other ones (seed 1):
            # the broadcast at the start of fit must give every rank rank 0's.
            model = _train(
                mode,
                detach_input,
                x,
                y,
                BATCH // world,
                initial=initial if rank == 0 else None,
                seed=rank,
            )
            for i, w in enumerate(model.get_weights()):
                results[f"{mode}_{detach_input}_{i}"] = to_numpy(w)
            report[f"{mode}_{detach_input}"] = {
                "launch_order": model._erase.grad_sync.launch_order,
                "choice": model.dispatch_choice,
            }
    report["presence"] = _presence_check(rank)
    return results, report


def _presence_check(rank):
    """A gradient that is None on rank 1 counts as zero there; None on every rank stays None."""
    import keras
    import torch

    from keras_erase.torch.distributed import GradientSync

    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernel, bias = layer.trainable_weights

    class _Model:
        trainable_weights = [kernel, bias]

        def detach_blocks(self):
            return []

    kernel.value.grad = torch.full(tuple(kernel.shape), 3.0) if rank == 0 else None
    bias.value.grad = None
    sync = GradientSync()
    sync.start_step(_Model())
    sync.reduce_rest()
    sync.finish()
    grad = kernel.value.grad
    return {
        "kernel": None if grad is None else grad.tolist(),
        "bias_is_none": bias.value.grad is None,
        "order": sync.launch_order,
    }


def test_two_gloo_ranks_on_half_batches_match_one_process_on_full_batches(tmp_path):
    from tests.backend_utils import to_numpy
    from tests.erase.test_erase import build_ctr, ctr_data

    # Initial weights (saved for rank 0) and the single-process reference (stock step).
    x, y = ctr_data(N)
    initials, references = {}, {}
    for detach_input in DETACH:
        initial = [to_numpy(w) for w in build_ctr("standard", num_towers=TOWERS,
                                                   detach_input=detach_input,
                                                   regularized=True).get_weights()]
        np.savez(tmp_path / f"initial_{detach_input}.npz",
                 **{f"w{i}": w for i, w in enumerate(initial)})
        initials[detach_input] = initial
        model = _train("standard", detach_input, x, y, BATCH, initial=initial)
        references[detach_input] = [to_numpy(w) for w in model.get_weights()]
        moved = max(np.abs(a - b).max() for a, b in zip(references[detach_input], initial))
        assert moved > 1e-2

    from keras_erase.torch.launch import run_local

    outputs = run_local(_rank_main, 2, args=(str(tmp_path),), threads_per_rank=1, timeout_s=240)
    ranks = [weights for weights, _ in outputs]
    reports = [report for _, report in outputs]
    blocks = [f"tower_{i}" for i in range(TOWERS)]
    for detach_input in DETACH:
        reference = references[detach_input]
        for mode in [m for m, d in CASES if d == detach_input]:
            key = f"{mode}_{detach_input}"
            for i, ref in enumerate(reference):
                w0, w1 = ranks[0][f"{key}_{i}"], ranks[1][f"{key}_{i}"]
                np.testing.assert_array_equal(w0, w1, err_msg=f"rank 1 != rank 0: {key} #{i}")
                np.testing.assert_allclose(w0, ref, rtol=1e-5, atol=2e-6, err_msg=f"{key} #{i}")
            order = [r[key]["launch_order"] for r in reports]
            assert order[0] == order[1], key
            choice = [r[key]["choice"] for r in reports]
            assert choice[0] == choice[1], key  # "auto" picks the same schedule everywhere
            expected = ["remainder"] if choice[0] == "standard" else blocks + ["remainder"]
            assert order[0] == expected, key
    for report in reports:
        presence = report["presence"]
        np.testing.assert_array_equal(np.asarray(presence["kernel"]), np.full((3, 2), 1.5))
        assert presence["bias_is_none"] and presence["order"] == ["remainder"]


def test_gradient_sync_is_inactive_without_a_process_group():
    from keras_erase.torch import distributed

    assert not distributed.active()



def test_run_local_reports_a_failing_rank_with_its_traceback():
    import operator

    from keras_erase.torch.launch import run_local

    # operator.getitem(rank, world) raises TypeError on every rank.
    with pytest.raises(RuntimeError, match=r"(?s)rank [01] failed:.*not subscriptable"):
        run_local(operator.getitem, 2, threads_per_rank=1, timeout_s=120)
    with pytest.raises(ValueError, match="nproc"):
        run_local(operator.getitem, 0)


# -- a layer used inside a block and on the main path ----------------------------------

SHARED_MODES = ("blocking", "threaded")
SHARED_STEPS, SHARED_BATCH = 2, 16


def build_shared_layer_model(dispatch, seed=0):
    """An EraseModel whose layer "shared" runs inside the block "tower" and on the main path.

    Its kernel gets the block's local-loss gradient (early backward) and the
    main loss's gradient (final backward): under torch.distributed it must be
    reduced after both.
    """
    import keras

    from keras_erase import DetachBlock
    from keras_erase import EraseModel

    keras.utils.set_random_seed(seed)
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    inputs = keras.Input((8,), name="features")
    tower = DetachBlock(
        keras.Sequential([shared, keras.layers.Dense(4, activation="relu")], name="mlp"),
        head=keras.layers.Dense(1, name="head"),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        loss_weight=0.5,
        name="tower",
    )
    hidden = keras.layers.Concatenate()([tower(inputs), shared(inputs)])
    outputs = keras.layers.Dense(1, activation="sigmoid", name="ctr")(hidden)
    return EraseModel(inputs, outputs, dispatch=dispatch, intra_op_threads=None)


def _train_shared(dispatch, x, y, batch_size, initial=None, seed=0):
    import keras

    model = build_shared_layer_model(dispatch, seed=seed)
    if initial is not None:
        model.set_weights(initial)
    model.compile(keras.optimizers.SGD(LR), keras.losses.BinaryCrossentropy())
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


def _shared_kernel(model):
    from tests.backend_utils import to_numpy

    layer = next(l for l in model.layers if l.name == "shared")
    return to_numpy(layer.kernel)


def _rank_rows(rank, world, n, batch):
    """A rank's batch size and its rows of `n`: its share of every global batch of `batch` rows."""
    per = batch // world
    return per, np.concatenate([np.arange(s + rank * per, s + (rank + 1) * per)
                                for s in range(0, n, batch)])


def _saved(path):
    """The weights saved with `np.savez(path, w0=..., w1=...)`, in order."""
    saved = np.load(path)
    return [saved[f"w{i}"] for i in range(len(saved.files))]


def _shared_rank_main(rank, world, path):
    from tests.backend_utils import to_numpy
    from tests.erase.test_erase import ctr_data

    x, y = ctr_data(SHARED_STEPS * SHARED_BATCH)
    per, rows = _rank_rows(rank, world, len(x), SHARED_BATCH)
    initial = _saved(path)
    out = {}
    for mode in SHARED_MODES:
        model = _train_shared(mode, x[rows], y[rows], per,
                              initial=initial if rank == 0 else None, seed=rank)
        out[mode] = [to_numpy(w) for w in model.get_weights()]
        out[mode + "_kernel"] = _shared_kernel(model)
        out[mode + "_order"] = model._erase.grad_sync.launch_order
    out["hidden_use"] = _hidden_use_error(x[rows], y[rows], per)
    return out


def _hidden_use_error(x, y, batch_size):
    """A subclassed model calls `tower.layer` on its main path (the layer walk cannot see it)."""
    import keras

    from keras_erase import DetachBlock
    from keras_erase import EraseModel

    class HiddenUse(EraseModel):
        def __init__(self):
            super().__init__(dispatch="blocking", intra_op_threads=None)
            self.tower = DetachBlock(keras.layers.Dense(4, name="inner"),
                                     head=keras.layers.Dense(1), loss="mse", name="tower")
            self.out = keras.layers.Dense(1, activation="sigmoid")

        def call(self, inputs):
            return self.out(self.tower(inputs) + self.tower.layer(inputs))

    keras.utils.set_random_seed(0)  # the same weights on both ranks: the broadcast changes none
    model = HiddenUse()
    model.compile(keras.optimizers.SGD(LR), "binary_crossentropy")
    model(x[:1])
    before = [np.array(w) for w in model.get_weights()]
    try:
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    except RuntimeError as error:
        unchanged = all((a == b).all() for a, b in zip(before, model.get_weights()))
        return {"message": str(error), "unchanged": unchanged}
    return {"message": None}


def test_a_layer_used_in_a_block_and_on_the_main_path_is_exact_on_two_gloo_ranks(tmp_path):
    """The shared kernel's gradient is the block's part plus the main loss's part on every rank."""
    from tests.backend_utils import to_numpy
    from tests.erase.test_erase import ctr_data

    x, y = ctr_data(SHARED_STEPS * SHARED_BATCH)
    initial = [to_numpy(w) for w in build_shared_layer_model("standard").get_weights()]
    np.savez(tmp_path / "initial.npz", **{f"w{i}": w for i, w in enumerate(initial)})
    reference = _train_shared("standard", x, y, SHARED_BATCH, initial=initial)
    reference_weights = [to_numpy(w) for w in reference.get_weights()]
    reference_kernel = _shared_kernel(reference)
    assert np.abs(reference_kernel - _shared_kernel(build_shared_layer_model("standard"))).max() > 1e-3

    from keras_erase.torch.launch import run_local

    ranks = run_local(_shared_rank_main, 2, args=(str(tmp_path / "initial.npz"),),
                      threads_per_rank=1, timeout_s=240)
    for mode in SHARED_MODES:
        off = float(np.abs(ranks[0][mode + "_kernel"] - reference_kernel).max())
        print(f"{mode}: shared kernel max |2 ranks - standard step| = {off:.3g}")
    for mode in SHARED_MODES:
        for i, ref in enumerate(reference_weights):
            np.testing.assert_array_equal(ranks[0][mode][i], ranks[1][mode][i], err_msg=mode)
            np.testing.assert_allclose(ranks[0][mode][i], ref, rtol=1e-5, atol=2e-6,
                                       err_msg=f"{mode} weight #{i}")
        # The shared kernel is reduced with the rest, after the main backward.
        assert ranks[0][mode + "_order"] == ["tower", "remainder"], mode
    for rank in ranks:  # refused at the first step, naming the weight, before any update
        hidden = rank["hidden_use"]
        assert hidden["message"] is not None and "tower/inner/kernel'" in hidden["message"]
        assert "DetachBlock 'tower'" in hidden["message"] and hidden["unchanged"]


# -- the mixed precision matrix on two ranks ------------------------------------------

# (dispatch, cuda_graphs): the standard step and every launcher, with and without graphs.
POLICY_MODES = (("standard", False), ("blocking", False), ("threaded", False),
                ("blocking", True), ("threaded", True))
USERS_OPTIONS = dict(reused=False, batch_norm=False, dropout=False)  # per-rank batches and masks


def _users_run(policy, mode, graphs, x, y, batch_size, initial=None, seed=0):
    from tests.backend_utils import dtype_policy
    from tests.erase.test_erase_schedules import fit_users, reconfigure, users_model

    with dtype_policy(policy):
        model = users_model(seed=seed, **USERS_OPTIONS)
        if initial is not None:
            model.set_weights(initial)
        reconfigure(model, dispatch=mode, cuda_graphs=graphs)
        return fit_users(model, x, y, batch_size=batch_size)


def _policy_rank_main(rank, world, path):
    """One rank: the users model under every policy and schedule, on its half of each batch."""
    import contextlib

    import torch

    from tests.backend_utils import POLICIES
    from tests.erase.test_cuda_graphs import stand_in_captures
    from tests.erase.test_erase_schedules import USERS_BATCH, users_data

    x, y = users_data()
    per, rows = _rank_rows(rank, world, len(x), USERS_BATCH)
    initial = _saved(path)
    out = {}
    captures = contextlib.nullcontext() if torch.cuda.is_available() else stand_in_captures()
    with captures:
        for policy in POLICIES:
            for mode, graphs in POLICY_MODES:
                run = _users_run(policy, mode, graphs, x[rows], y[rows], per,
                                 initial=initial if rank == 0 else None, seed=rank)
                out[f"{policy} {mode} graphs={graphs}"] = run
    return out


def test_the_models_users_have_on_two_gloo_ranks_under_every_policy(tmp_path):
    """Every policy x schedule on two ranks: the ranks agree exactly, and each equals one
    process's standard step on the full batches within the policy's own error."""
    from tests.backend_utils import POLICIES
    from tests.erase.test_erase_schedules import (
        USERS_BATCH, assert_like_the_standard_step, fit_users, users_data, users_model,
    )

    from keras_erase.torch.launch import run_local

    initial = users_model(**USERS_OPTIONS).get_weights()
    np.savez(tmp_path / "initial.npz", **{f"w{i}": np.asarray(w) for i, w in enumerate(initial)})
    x, y = users_data()
    truth = _users_run("float64", "standard", False, x, y, USERS_BATCH)
    ranks = run_local(_policy_rank_main, 2, args=(str(tmp_path / "initial.npz"),),
                      threads_per_rank=1, timeout_s=600, backend="gloo")
    for policy in POLICIES:
        want = _users_run(policy, "standard", False, x, y, USERS_BATCH)
        for mode, graphs in POLICY_MODES:
            key = f"{policy} {mode} graphs={graphs}"
            for a, b in zip(ranks[0][key]["weights"], ranks[1][key]["weights"]):
                np.testing.assert_array_equal(a, b, err_msg=f"rank 1 != rank 0: {key}")
            error, own = assert_like_the_standard_step(ranks[0][key], want, truth, key, logs=False)
            print(f"{key}: worst weight off float64 by {error:.3g} of its move (one process's "
                  f"standard step: {own:.3g})")


# -- when each block's all-reduce starts against the next block's forward -----------------------------

TIMELINE_BLOCKS = 4


def _timeline_rank(rank, world, dispatch):
    """One traced step of a chain of detached blocks: each event's start and end, ms from the step's start."""
    import time

    import keras

    from keras_erase import DetachBlock, EraseModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = inputs
    for b in range(TIMELINE_BLOCKS):
        h = DetachBlock(keras.Sequential([keras.layers.Dense(256, "relu") for _ in range(2)]),
                        head=keras.layers.Dense(1), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                        name=f"block_{b}")(h)
    model = EraseModel(inputs, keras.layers.Dense(1, "sigmoid")(h), dispatch=dispatch, intra_op_threads=None)
    model.compile(keras.optimizers.SGD(0.01), "binary_crossentropy")
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    model.train_on_batch(x, y)  # the first step: the broadcast, the ownership check
    events = model.start_trace()
    start = time.perf_counter()
    model.train_on_batch(x, y)
    model.stop_trace()
    return [{"block": e["block"], "phase": e["phase"], "start_ms": 1e3 * (e["start"] - start),
             "end_ms": 1e3 * (e["end"] - start)} for e in events if e["phase"] != "submit"]


def timeline_table(events):
    """The markdown table of one rank's step: per block, its forward, backward and all-reduce launch."""
    lines = ["| block | forward (ms) | backward (ms) | all-reduce launched (ms) |", "|---|---|---|---|"]
    for b in range(TIMELINE_BLOCKS):
        phase = {e["phase"]: e for e in events if e["block"] == f"block_{b}"}
        lines.append(f"| block_{b} | " + " | ".join(
            f"{phase[p]['start_ms']:.1f}-{phase[p]['end_ms']:.1f}" for p in ("forward", "backward", "all_reduce"))
            + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("dispatch", ["blocking", "threaded"])
def test_each_blocks_all_reduce_starts_before_the_step_ends_on_two_gloo_ranks(dispatch):
    """The per-block all-reduce overlaps the later blocks' work: launched (asynchronously) right after
    the block's backward, in block order on both ranks; with the inline launcher before the next
    block's forward starts, with the worker while later forwards run. Prints rank 0's timeline
    (docs/erase.md shows one)."""
    from keras_erase.torch.launch import run_local

    ranks = run_local(_timeline_rank, 2, args=(dispatch,), timeout_s=300)
    for rank, events in enumerate(ranks):
        print(f"rank {rank}, dispatch={dispatch!r}:\n{timeline_table(events)}")
        of = {(e["block"], e["phase"]): e for e in events}
        launches = [e for e in events if e["phase"] == "all_reduce"]
        assert [e["block"] for e in launches] == [f"block_{b}" for b in range(TIMELINE_BLOCKS)]
        for b in range(TIMELINE_BLOCKS):
            assert of[(f"block_{b}", "all_reduce")]["start_ms"] >= of[(f"block_{b}", "backward")]["end_ms"]
        if dispatch == "blocking":  # launched before the next block's forward starts
            for b in range(TIMELINE_BLOCKS - 1):
                assert of[(f"block_{b}", "all_reduce")]["end_ms"] <= of[(f"block_{b + 1}", "forward")]["start_ms"]
