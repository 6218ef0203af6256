"""CUDA Graphs never alias or leak (torch, CPU stand-in capture `RecordingCapture`).

- A block met twice in a step (a shared tower) trains like eager in blocking and
  threaded: a graph's static buffers are never handed out as gradients, and each
  occurrence has its own graphs (a later forward replay never overwrites what an
  earlier backward replay reads); with the worker launcher such a block is refused
  graphs at the first step (a real capture would reach the weights' gradient
  accumulators, alive on the main stream for the earlier call's queued backward).
- Graphs are released when a schedule_run closes (every mode), when `fit` ends, when
  `"auto"` drops a schedule, and when the model is garbage-collected.
- The capture lock is one per process.
"""

import gc
import weakref

import keras
import numpy as np
import pytest

from keras_erase.torch.train_step import close_schedule_runs
from tests.backend_utils import BACKEND, to_numpy
from tests.erase.test_cuda_graphs import stand_in_captures, train_block

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="CUDA Graphs are torch's")

N, BATCH = 64, 8  # 8 steps per epoch


def shared_tower_model(mode, graphs, detach_input=True, twice=True):
    """One `DetachBlock` applied to two inputs in every step (or, `twice=False`, two blocks).

    With the worker launcher a block met twice is refused graphs: the lifecycle tests
    of `"threaded"` use two blocks, which keep theirs.
    """
    from keras_erase import DetachBlock, EraseModel

    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    left = keras.layers.Dense(6, name="left")(inputs)
    right = keras.layers.Dense(6, name="right")(inputs)

    def tower(name):
        return DetachBlock(
            keras.Sequential([keras.layers.Dense(8, "relu"), keras.layers.Dense(4)]),
            head=keras.layers.Dense(1),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            detach_input=detach_input,
            name=name,
        )

    first = tower("shared_tower")
    second = first if twice else tower("second_tower")
    h = keras.layers.Concatenate()([first(left), second(right)])
    outputs = keras.layers.Dense(1, "sigmoid")(h)
    model = EraseModel(
        inputs, outputs, dispatch=mode, cuda_graphs=graphs, intra_op_threads=None
    )
    model.compile(keras.optimizers.SGD(0.2), "binary_crossentropy")
    return model


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = (x[:, :1] + 0.3 * rng.normal(size=(N, 1)) > 0).astype("float32")
    return x, y


@pytest.fixture
def stand_in():
    """`cuda_graphs=True` captures with `RecordingCapture` on this CPU machine; yields them."""
    with stand_in_captures() as captures:
        yield captures


def runner_of(model, label):
    """The graph runner of the model's graphed schedule_run for `label` (`"threaded"`, ...)."""
    from keras_erase.config import Schedule

    schedule = Schedule.from_name(label.removesuffix("+graphs") + "+graphs")
    return model._erase.schedule_runs[schedule].graphs


@pytest.mark.parametrize("mode", ["blocking", "threaded"])
@pytest.mark.parametrize("detach_input", [True, False])
def test_a_block_met_twice_per_step_trains_like_eager(mode, detach_input, stand_in):
    x, y = data()
    reference = shared_tower_model("standard", False, detach_input)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    eager = shared_tower_model(mode, False, detach_input)
    eager.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    graphed = shared_tower_model(mode, True, detach_input)
    counts, refused = [], []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda *_, **__: (
        counts.append(runner_of(graphed, mode).replays),
        refused.append(dict(runner_of(graphed, mode).refused))))
    graphed.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    runner = runner_of(graphed, mode)
    assert not runner.disabled, runner.disabled_reason
    if mode == "blocking":
        assert runner.captures == 2 and not runner.refused  # one graph pair per occurrence
        assert counts[-1] == 2 * (N // BATCH - 2)  # both occurrences replayed after warm-up
    else:  # the first call's backward, queued on the worker, would hold the weights at the capture
        assert list(refused[0]) == ["shared_tower"]  # refused at the first step, named
        assert "called 2 times in a step" in refused[0]["shared_tower"]
        assert runner.captures == 0 and counts[-1] == 0
    for a, b, c in zip(graphed.get_weights(), eager.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(to_numpy(b), to_numpy(c), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["blocking", "threaded", "streams"])
def test_closing_a_schedule_run_releases_its_graphs(mode):
    _, _, schedule_run, capture = train_block(mode, True, close=False)
    assert schedule_run.graphs.captures == 1 and capture.live == 2  # forward + backward
    schedule_run.close()
    assert capture.released == 2 and capture.live == 0
    assert schedule_run.graphs._graphs == {}


@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_fit_releases_the_graphs_when_training_ends(mode, stand_in):
    x, y = data()
    model = shared_tower_model(mode, True, twice=mode == "blocking")
    live = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: live.append(stand_in[0].live)
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    assert live[-1] == 4  # two blocks or occurrences x (forward, backward) while training
    assert stand_in[0].live == 0 and stand_in[0].released == 4


def test_auto_releases_the_graphs_of_the_schedule_it_drops(stand_in, auto_measures, monkeypatch):
    from keras_erase.torch import auto as auto_schedule

    # Two graphed candidates; the slower one is dropped with its graphs.
    monkeypatch.setattr(auto_schedule, "auto_candidates",
                        lambda graphs=False: ["blocking+graphs", "threaded+graphs"])
    x, y = data()
    model = shared_tower_model("auto", True, twice=False)
    model._erase.config = type(model._erase.config)(
        dispatch="auto", cuda_graphs=True, intra_op_threads=None, auto_steps=1
    )
    seen, runners = {}, {}

    def check(*_, **__):
        # a measured candidate's run leaves `schedule_runs` (closed): keep each runner seen
        runners.update((s.name, r.graphs) for s, r in model._erase.schedule_runs.items())
        choice = model.dispatch_choice
        if choice is not None and "dropped" not in seen:
            dropped = "threaded+graphs" if choice == "blocking+graphs" else "blocking+graphs"
            runner = runners[dropped]
            seen["dropped"] = (runner.captures, runner._graphs, runner._capture.live)

    record = keras.callbacks.LambdaCallback(on_train_batch_end=check)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    captures, graphs, live = seen["dropped"]
    assert captures == 2  # it had captured (the check can fail) ...
    assert graphs == {} and live == 0  # ... and released them once dropped


def test_graphs_are_freed_with_their_model(stand_in):
    x, y = data()
    model = shared_tower_model("threaded", True, twice=False)
    for step in range(5):  # train_on_batch keeps the schedule_runs (no end of training)
        model.train_on_batch(x[:BATCH], y[:BATCH])
    runner = weakref.ref(runner_of(model, "threaded"))
    capture = stand_in[0]
    assert runner().captures == 2 and capture.live == 4
    del model
    gc.collect()
    assert runner() is None
    assert capture.live == 0


def test_the_capture_lock_is_one_per_process(monkeypatch):
    import torch

    from keras_erase.torch.cuda_graphs import capture as graph_capture

    monkeypatch.setattr(torch.cuda, "Stream", lambda: object())
    first, second = graph_capture.CudaGraphCapture(), graph_capture.CudaGraphCapture()
    assert first.lock is second.lock
    assert "process" in type(first).__doc__ or "process" in graph_capture.__doc__


@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_gradients_are_never_a_graphs_static_buffer(mode, stand_in):
    x, y = data()
    model = shared_tower_model(mode, True, detach_input=False, twice=mode == "blocking")
    for _ in range(4):  # 2 eager warm-up steps, a capture step, a replay step
        model.train_on_batch(x[:BATCH], y[:BATCH])
    graphs = list(runner_of(model, mode)._graphs.values())
    assert len(graphs) == 2
    static = {
        t.untyped_storage().data_ptr()
        for graph in graphs
        for t in graph.backward.outputs
        if t is not None
    }
    grads = [v.value.grad for v in model.get_layer("shared_tower").trainable_weights]
    assert all(g is not None for g in grads)
    assert not static & {g.untyped_storage().data_ptr() for g in grads}
    close_schedule_runs(model._erase)  # the worker thread ends now, not at garbage collection
