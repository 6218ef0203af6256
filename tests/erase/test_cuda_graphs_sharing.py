"""CUDA Graphs meet what a real capture meets (torch; CPU stand-in capture, CUDA parts in the GPU check).

- A block whose weights another autograd graph holds when it is captured (a weight
  shared with the main path or another block, an earlier call's backward still queued
  on the worker) would make that graph's stream wait on an event recorded inside the
  capture (torch 2.9+), which breaks it: such a block is refused graphs at the first
  step, named, and trains eagerly while the other blocks keep theirs; the probe
  (`held_weights`) refuses what the layer walk cannot see, before any capture.
- Unseeded `Dropout` replays as eager: a capture leaves the random generator as it was
  (torch's graph-safe CUDA generator; the stand-in restores the CPU one).
- A capture that raises leaves torch's caching allocator usable (`empty_cache()` and a
  new capture work after it; on CUDA only in the GPU check).
"""

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock
from keras_erase.config import Schedule
from tests.backend_utils import BACKEND, to_numpy
from tests.erase.test_cuda_graphs import batches, make_block, make_schedule_run, needs_cuda, sgd_
from tests.erase.test_cuda_graphs import stand_in_captures, train_block_with, zero_

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="CUDA Graphs are torch's")

N, BATCH = 48, 8  # 6 steps


def sharing_model(mode, graphs, share="main"):
    """Two blocks; `tower`'s first Dense is also used on the main path (or by `other`)."""
    from keras_erase import EraseModel

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(6, name="shared")

    def block(layers, name):
        return DetachBlock(keras.Sequential(layers, name=f"{name}_layers"),
                           head=keras.layers.Dense(1, name=f"{name}_head"),
                           loss=keras.losses.BinaryCrossentropy(from_logits=True), name=name)

    tower = block([shared, keras.layers.Dense(4, name="tower_dense")], "tower")
    other = block(([shared] if share == "block" else []) + [keras.layers.Dense(4, name="own")],
                  "other")
    parts = [tower(inputs), other(inputs)] + ([shared(inputs)] if share == "main" else [])
    outputs = keras.layers.Dense(1, "sigmoid")(keras.layers.Concatenate()(parts))
    model = EraseModel(inputs, outputs, dispatch=mode, cuda_graphs=graphs, intra_op_threads=None)
    model.compile(keras.optimizers.SGD(0.2), "binary_crossentropy")
    return model


def data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 6)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


@pytest.mark.parametrize("mode", ["blocking", "threaded"])
@pytest.mark.parametrize("share", ["main", "block"])
def test_a_block_sharing_a_weight_is_refused_at_the_first_step(mode, share):
    x, y = data()
    eager = sharing_model(mode, False, share)
    eager.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    with stand_in_captures():
        graphed = sharing_model(mode, True, share)
        graphed.train_on_batch(x[:BATCH], y[:BATCH])  # the first step
        runner = graphed._erase.schedule_runs[Schedule.from_name(mode + "+graphs")].graphs
        refused = dict(runner.refused)
        graphed.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    expected = ["tower"] if share == "main" else ["tower", "other"]
    assert sorted(refused) == sorted(expected)  # named at the first step
    assert "'tower/tower_layers/shared/kernel'" in refused["tower"]
    assert not runner.disabled, runner.disabled_reason
    assert runner.captures == (1 if share == "main" else 0)  # "other" owns its weights there
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-6)


def test_held_weights_names_a_weight_another_graph_holds():
    from keras_erase.torch.cuda_graphs.runner import held_weights

    block = make_block()
    kernel = block.trainable_weights[0]
    assert held_weights(block) == []
    kept = kernel.value * 2.0  # a live graph reaches the kernel's gradient accumulator
    assert held_weights(block) == [kernel.path]
    assert held_weights(block) == [kernel.path]  # the probe changes nothing
    del kept
    assert held_weights(block) == []


def test_a_weight_held_at_the_capture_is_refused_before_any_capture(caplog):
    """What the layer walk cannot see (here: a graph kept from outside) the probe refuses."""
    block = make_block()
    schedule_run, capture = make_schedule_run("blocking", True)  # warm-up 1: captures at step 2
    kept = []
    for step, (x, y, sw) in enumerate(batches(3)):
        zero_(block.trainable_weights)
        if step == 1:
            kept.append(block.trainable_weights[0].value.sum())
        schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.finish()
        sgd_(block.trainable_weights)
    runner = schedule_run.graphs
    assert capture.captured == [] and runner.captures == 0  # refused before capturing
    assert list(runner.refused) == ["block"]
    assert "held by another autograd graph" in runner.refused["block"]
    assert "CUDA Graphs refused for block 'block'" in caplog.text
    assert not runner.disabled  # the other blocks would keep their graphs


@pytest.mark.parametrize("capture", ["stand_in", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_unseeded_dropout_replays_as_eager(mode, capture):
    """Unseeded Dropout draws from torch's global generator: a capture leaves it as it was and each
    replay draws where the eager step would have (real CUDA Graphs: torch's graph-safe generator; the
    stand-in: its generators forked around the recorded region, the GPU's too on a GPU machine)."""
    def train(graphs):
        keras.utils.set_random_seed(6)
        layer = keras.Sequential([keras.layers.Dense(16, "relu"), keras.layers.Dropout(0.3),
                                  keras.layers.Dense(4)])
        # the same draws from the block's first step on, with and without graphs
        return train_block_with(layer, mode, graphs, steps=6, torch_seed=11,
                                device_capture=capture == "cuda")

    eager, _ = train(False)
    graphed, runner = train(True)
    assert runner.captures == 1 and runner.replays == 5  # warm-up 1: steps 2-6 replay
    for a, b in zip(graphed, eager):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- CUDA only (scripts/gpu_check.sh runs them) ---------------------------------------------


@needs_cuda
@pytest.mark.parametrize("mode", ["blocking", "threaded", "streams"])
def test_a_shared_weight_trains_like_eager_on_gpu(mode):
    """On a GPU: the refused block trains eagerly, the other is captured, nothing breaks."""
    x, y = data()
    eager = sharing_model(mode, False)
    eager.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    graphed = sharing_model(mode, True)
    graphed.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    (runner,) = [d.graphs for d in graphed._erase.schedule_runs.values() if d.graphs is not None]
    assert list(runner.refused) == ["tower"] and runner.captures == 1, runner.disabled_reason
    assert not runner.disabled and runner.replays > 0
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-4, atol=1e-5)
