"""Torch-only ERASE schedule tests: same weights for every dispatch mode, the threaded
schedule's overlap and ordering (timestamps), failures in a block's backward, thread
policy, and CUDA-only checks (skipped without CUDA)."""

import faulthandler
import gc
import logging
import time
import threading
import traceback
import warnings

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock, EraseModel
from keras_erase.config import Schedule
from tests.backend_utils import BACKEND, to_numpy
from tests.erase.test_erase import build_ctr, ctr_data, make_tower, train

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="ERASE dispatch runs on torch")


def _cuda():
    import torch

    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(BACKEND != "torch" or not _cuda(), reason="needs CUDA")
needs_cpu_only = pytest.mark.skipif(BACKEND != "torch" or _cuda(), reason="checks the no-CUDA error")


@pytest.fixture
def hang_guard():
    """Kills the run with a traceback dump instead of hanging forever."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _train_mode(dispatch, x, y, epochs=2, **kwargs):
    model = build_ctr(dispatch, **kwargs)
    history = train(model, x, y, optimizer=keras.optimizers.Adam(0.01), epochs=epochs)
    return model, [to_numpy(w) for w in model.get_weights()], history


@pytest.mark.parametrize("detach_input", [True, False])
@pytest.mark.slow
def test_every_dispatch_mode_gives_the_standard_weights_and_logs(detach_input, hang_guard):
    x, y = ctr_data(64)
    kwargs = dict(detach_input=detach_input, auto_steps=1)  # auto decides within 6 steps
    _, reference, ref_history = _train_mode("standard", x, y, **kwargs)
    initial = [to_numpy(w) for w in build_ctr("standard", **kwargs).get_weights()]
    assert max(np.abs(a - b).max() for a, b in zip(reference, initial)) > 1e-3
    for mode in ("blocking", "threaded", "auto"):
        model, weights, history = _train_mode(mode, x, y, **kwargs)
        for a, b in zip(weights, reference):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=mode)
        assert set(history) == set(ref_history)
        for key in ref_history:
            np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-6, err_msg=key)
        if mode == "auto" and not _cuda():  # the standard step, measured nothing
            assert model.dispatch_choice == "standard" and model._erase.selector is None


def test_block_regularizers_and_add_loss_train_with_the_early_backward(hang_guard):
    """A block's regularizers and activity regularizer (`add_loss`) are part of its early
    backward: every mode gives the standard weights and logs, and no backward runs through
    the block's graph a second time."""
    x, y = ctr_data(64)
    kwargs = dict(num_towers=2, regularized=True, auto_steps=1)
    _, reference, ref_history = _train_mode("standard", x, y, **kwargs)
    for mode in ("blocking", "threaded", "auto"):
        _, weights, history = _train_mode(mode, x, y, **kwargs)
        for a, b in zip(weights, reference):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=mode)
        for key in ref_history:
            np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-6, err_msg=key)


def test_auto_candidates_on_cuda_meet_what_the_gpu_check_expects():
    """The candidates `auto` measures on CUDA: the standard step first, then the schedules."""
    from keras_erase.torch.auto import auto_candidates

    assert auto_candidates() == ["standard", "threaded", "streams"]  # the worker's schedules
    graphed = auto_candidates(graphs=True)
    assert graphed[:3] == auto_candidates() and graphed[3:] == [
        f"{label}+graphs" for label in auto_candidates()[1:]]


@pytest.mark.skipif(BACKEND != "torch" or _cuda(), reason="auto's CPU rule (no CUDA)")
@pytest.mark.parametrize("intra_op_threads", ["auto", 1])
def test_auto_on_cpu_takes_no_measuring_step(intra_op_threads, two_threads, monkeypatch, caplog):
    """On a CPU `auto` is the standard step from the first step: no selector, no trial
    schedule, no timed step, the threads `dispatch="standard"` would run (the current count,
    or the one asked for), and it says so before and after."""
    import torch

    from keras_erase.torch import train_step

    def refuse(*_, **__):
        raise AssertionError("auto measured or ran an early-backward step on CPU")

    for name in ("new_selector", "schedule_run_for", "erase_step"):
        monkeypatch.setattr(train_step, name, refuse)
    threads = two_threads if intra_op_threads == "auto" else intra_op_threads
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: seen.append(torch.get_num_threads()))
    model = build_ctr("auto", intra_op_threads=intra_op_threads)
    text = ("dispatch='auto' on CPU: the standard step; ERASE's early backward needs a GPU to "
            "overlap. Every step, from the first, runs the standard step and nothing is measured")
    before = model.dispatch_explanation
    assert model.dispatch_choice == "standard" and before.startswith(text)
    x, y = ctr_data(64)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    with caplog.at_level(logging.INFO, logger="keras_erase"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[probe])
    assert not [w for w in caught if "dispatch='auto'" in str(w.message)]  # no "still measuring"
    assert len(seen) == 4 and set(seen) == {threads}
    assert torch.get_num_threads() == two_threads  # restored after fit
    assert model._erase.selector is None and model.auto_timings == {}
    assert model._erase.schedule_runs == {}
    assert model.dispatch_choice == "standard"
    assert model.dispatch_explanation == before
    assert not [r for r in caplog.records if "dispatch='auto'" in r.getMessage()]


def test_threaded_thread_policy_applies_during_fit_and_is_restored():
    import torch

    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    model = build_ctr("threaded", intra_op_threads=1)
    x, y = ctr_data(32)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Probe()])
    assert seen == [1, 1]
    assert torch.get_num_threads() == before


@pytest.fixture
def two_threads():
    """The main thread at 2 intra-op threads during the test, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.mark.parametrize("dispatch", ["threaded", "blocking", "auto"])
def test_train_on_batch_restores_the_thread_count(dispatch, two_threads):
    import torch

    model = build_ctr(dispatch, intra_op_threads=1, auto_steps=1)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    x, y = ctr_data(16)
    for _ in range(3):
        model.train_on_batch(x, y)
        assert torch.get_num_threads() == two_threads
    model.fit(x, y, epochs=1, verbose=0)
    assert torch.get_num_threads() == two_threads


def _live_workers():
    """The backward workers alive once garbage is collected (earlier tests' models included)."""
    from keras_erase.torch.schedules.worker import NAME

    gc.collect()
    return [t for t in threading.enumerate() if t.name == NAME and t.is_alive()]


def _wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_worker_threads_end_with_their_model_and_with_training(hang_guard):
    x, y = ctr_data(16)
    assert _wait_for(lambda: not _live_workers())
    models = []
    for _ in range(3):
        model = build_ctr("threaded", num_towers=2)
        model.compile(optimizer="sgd", loss="binary_crossentropy")
        model.train_on_batch(x, y)  # a worker per model, alive between steps
        models.append(model)
    assert len(_live_workers()) == 3
    del models, model
    gc.collect()
    assert _wait_for(lambda: not _live_workers()), _live_workers()  # garbage-collected
    model = build_ctr("threaded", num_towers=2)
    train(model, x, y, epochs=1)
    assert _wait_for(lambda: not _live_workers())  # fit ended: the worker ended
    history = train(model, x, y, epochs=1)  # and the next fit starts a new one
    assert np.isfinite(history["loss"]).all()


def test_auto_ends_the_workers_of_the_schedules_it_leaves(hang_guard, auto_measures):
    from keras_erase.torch.auto import ScheduleSelector

    assert _wait_for(lambda: not _live_workers())  # none left by earlier tests
    model = build_ctr("auto", num_towers=2)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    # margin 0.99: the standard step is kept unless threaded is 100x faster
    model._erase.selector = ScheduleSelector(["standard", "threaded"], timed_rounds=1, margin=0.99)
    x, y = ctr_data(16)
    model.train_on_batch(x, y)  # standard (warm-up)
    model.train_on_batch(x, y)  # threaded (warm-up): its worker starts
    assert len(_live_workers()) == 1
    while not model._erase.selector.done:
        model.train_on_batch(x, y)
    assert model.dispatch_choice == "standard"
    assert _wait_for(lambda: not _live_workers())


def test_worker_sets_its_own_intra_op_team_size(two_threads):
    """OpenMP teams are per thread: a thread keeps the count it had at its first
    parallel op, whatever the main thread sets later; so the worker sets its own."""
    import torch

    from keras_erase.torch.schedules import make_schedule_run

    threaded = Schedule("worker", "default_stream")

    def count_in_worker(schedule_run):
        seen = []
        schedule_run._worker.submit(lambda: seen.append(torch.get_num_threads()))
        schedule_run.finish()
        return seen[0]

    # What the policy is built on: a plain worker started while the main thread had 1
    # thread keeps 1 after the main thread goes back to 2.
    torch.set_num_threads(1)
    plain = make_schedule_run(threaded)
    assert count_in_worker(plain) == 1
    torch.set_num_threads(2)
    assert count_in_worker(plain) == 1
    plain.close()
    # The worker with its own count: 2 although it started while the main thread had 1,
    # then 1 when asked, while the main thread stays at 2.
    torch.set_num_threads(1)
    own = make_schedule_run(threaded, worker_threads=2)
    assert count_in_worker(own) == 2
    torch.set_num_threads(2)
    own.launcher.worker.threads = 1
    assert count_in_worker(own) == 1
    assert torch.get_num_threads() == 2
    own.close()


def test_threaded_model_worker_uses_the_policy_count(two_threads):
    import torch

    model = build_ctr("threaded", intra_op_threads=1)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    x, y = ctr_data(16)
    model.train_on_batch(x, y)
    schedule_run = model._erase.schedule_runs[Schedule.from_name("threaded")]
    seen = []
    schedule_run._worker.submit(lambda: seen.append(torch.get_num_threads()))
    schedule_run.finish()
    assert seen == [1] and torch.get_num_threads() == two_threads
    schedule_run.close()


def _trace_steps(events, blocks):
    """Splits a trace into steps: each step holds one forward per block."""
    forwards = [e for e in events if e["phase"] == "forward"]
    steps = []
    for i in range(0, len(forwards), len(blocks)):
        window = forwards[i : i + len(blocks)]
        start = window[0]["start"]
        end = forwards[i + len(blocks)]["start"] if i + len(blocks) < len(forwards) else np.inf
        steps.append([e for e in events if start <= e["start"] < end])
    return steps


def test_threaded_backward_overlaps_a_later_blocks_forward(hang_guard):
    """Timestamps: some block's backward (worker) runs while a later block's forward runs."""
    keras.utils.set_random_seed(0)
    num_towers, width, dim = 4, 384, 256
    model = build_ctr("threaded", num_towers=num_towers, width=width, depth=3, input_dim=dim)
    x, y = ctr_data(512 * 3, input_dim=dim)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    events = model.start_trace()
    model.fit(x, y, batch_size=512, epochs=1, shuffle=False, verbose=0)
    model.stop_trace()
    names = [f"tower_{i}" for i in range(num_towers)]
    main = threading.get_ident()
    overlaps = 0
    for step in _trace_steps(events, names):
        fwd = {e["block"]: e for e in step if e["phase"] == "forward"}
        bwd = {e["block"]: e for e in step if e["phase"] == "backward"}
        assert set(fwd) == set(bwd) == set(names)
        assert all(e["thread"] == main for e in fwd.values())
        assert all(e["thread"] != main for e in bwd.values())
        for i, early in enumerate(names):
            for later in names[i + 1 :]:
                b, f = bwd[early], fwd[later]
                if b["start"] < f["end"] and f["start"] < b["end"]:
                    overlaps += 1
    assert overlaps > 0, events


def test_backward_submitted_before_next_forward_and_run_in_order(hang_guard):
    model = build_ctr("threaded", num_towers=3)
    x, y = ctr_data(48)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    events = model.start_trace()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.stop_trace()
    names = ["tower_0", "tower_1", "tower_2"]
    steps = _trace_steps(events, names)
    assert len(steps) == 3
    for step in steps:
        fwd = [e for e in step if e["phase"] == "forward"]
        sub = [e for e in step if e["phase"] == "submit"]
        bwd = sorted((e for e in step if e["phase"] == "backward"), key=lambda e: e["start"])
        assert [e["block"] for e in fwd] == names
        assert [e["block"] for e in sub] == names
        assert [e["block"] for e in bwd] == names  # FIFO worker
        for b in range(len(names)):
            assert fwd[b]["end"] <= sub[b]["start"] <= bwd[b]["start"]
            if b + 1 < len(names):
                assert sub[b]["start"] <= fwd[b + 1]["start"]


class FailingBackward(keras.layers.Layer):
    """Identity-like layer whose backward raises while `fail` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fail = True

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, inputs):
        import torch

        layer = self

        class _Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                if layer.fail:
                    raise RuntimeError("boom in a block's backward")
                return grad

        return _Boom.apply(inputs * self.scale)


@pytest.mark.parametrize("dispatch", ["threaded", "blocking"])
def test_error_in_block_backward_surfaces_and_next_fit_works(dispatch, hang_guard):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    boom = FailingBackward(name="boom")
    good = DetachBlock(make_tower(8, 1), head=keras.layers.Dense(1), loss="mse", name="good")(
        inputs
    )
    bad = DetachBlock(
        keras.Sequential([keras.layers.Dense(8), boom]),
        head=keras.layers.Dense(1),
        loss="mse",
        name="bad",
    )(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Concatenate()([good, bad]))
    model = EraseModel(inputs, outputs, dispatch=dispatch)
    model.compile(optimizer="sgd", loss="mse")
    x, y = ctr_data(32)
    threads_before = threading.active_count()
    with pytest.raises(RuntimeError, match="boom in a block's backward") as info:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "backward" in "".join(traceback.format_exception(info.value))
    boom.fail = False
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    assert np.isfinite(history["bad_loss"]).all() and len(history["loss"]) == 2
    assert all(np.isfinite(to_numpy(w)).all() for w in model.get_weights())
    assert threading.active_count() <= threads_before + 1


@needs_cpu_only
@pytest.mark.parametrize("dispatch,cuda_graphs", [("streams", False), ("threaded", True)])
def test_cuda_models_load_predict_evaluate_on_cpu_and_refuse_to_train(
    dispatch, cuda_graphs, tmp_path
):
    """Saved with streams/CUDA Graphs: loads, predicts and evaluates without CUDA; the first
    torch train step refuses with the clear message."""
    model = build_ctr(dispatch, cuda_graphs=cuda_graphs)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    x, y = ctr_data(32)
    path = str(tmp_path / "cuda.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert (loaded.dispatch, loaded.cuda_graphs) == (dispatch, cuda_graphs)
    np.testing.assert_allclose(
        to_numpy(loaded.predict(x, verbose=0)), to_numpy(model.predict(x, verbose=0)), rtol=1e-6
    )
    results = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert np.isfinite(results["loss"]) and "tower_0_loss" in results
    with pytest.raises(ValueError, match="needs a CUDA device"):
        loaded.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        model.train_on_batch(x, y)


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_streams_give_the_standard_weights(cuda_graphs):
    x, y = ctr_data(64)
    _, reference, ref_history = _train_mode("standard", x, y, epochs=3)
    _, weights, history = _train_mode("streams", x, y, epochs=3, cuda_graphs=cuda_graphs,
                                      num_streams=2)
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)


def test_block_weight_penalties_make_no_tensor_from_host_data():
    """A block's L1/L2/L1L2 weight penalties (its own losses, in its early backward) are
    computed with Python-float factors: no op a CUDA Graph capture refuses. Keras's own
    regularizer call (the control) casts its factor to a tensor from host data."""
    import torch

    from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops
    from tests.backend_utils import TorchOpRecorder

    layer = keras.Sequential([
        keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.05)),
        keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02),
                           bias_regularizer=keras.regularizers.L1(0.03)),
    ])
    block = DetachBlock(layer, head=keras.layers.Dense(1), loss="mse", name="reg")
    block.build((None, 3))
    weights = [v.value for v in block.trainable_weights]
    recorder = TorchOpRecorder()
    with recorder:
        penalty = block.own_losses()
        torch.autograd.grad(penalty, weights, allow_unused=True)
    assert forbidden_ops(recorder.ops) == []
    expected = sum(
        float(v.regularizer(v)) for v in block.trainable_weights if v.regularizer is not None
    )
    np.testing.assert_allclose(float(penalty), expected, rtol=1e-6)
    control = TorchOpRecorder()
    with control:
        keras.regularizers.L2(0.05)(block.trainable_weights[0])
    assert forbidden_ops(control.ops) != []


def test_a_fit_that_ends_while_auto_measures_says_so_and_what_ran(auto_measures, monkeypatch):
    from keras_erase.torch import auto as auto_schedule

    monkeypatch.setattr(auto_schedule, "auto_candidates",
                        lambda graphs=False: ["standard", "blocking", "threaded"])
    model = build_ctr("auto", auto_steps=8)  # needs far more than the 4 steps of this fit
    x, y = ctr_data(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, x, y, epochs=1)
    assert model.dispatch_choice is None
    notes = [str(w.message) for w in caught if "still measuring" in str(w.message)]
    assert len(notes) == 1
    assert "still measuring after 4 steps when fit ended" in notes[0]
    assert "dispatch_choice is None" in notes[0]
    # round robin: each candidate's warm-up step, then the standard step's first timed one
    assert "standard (Keras's train step): 2 steps, median " in notes[0]
    for mode in ("blocking", "threaded"):
        assert (f"{auto_schedule.describe_schedule(mode)}: 1 step, no timed step yet"
                in notes[0])
    assert "still measuring after 4 steps" in model.dispatch_explanation
    train(model, x, y, epochs=6)  # the next fit goes on measuring (at most 27 steps), keeps one
    assert model.dispatch_choice is not None
    assert "kept" in model.dispatch_explanation


def test_auto_explanation_prints_the_numbers_each_schedule_was_judged_on():
    """A schedule dropped early is shown with the two medians that dropped it, not beside
    the baseline's final median, which later steps moved (here 11.0 ms -> 21.0 ms)."""
    from types import SimpleNamespace

    from keras_erase.torch.auto import ScheduleSelector
    from keras_erase.torch.auto import explain

    selector = ScheduleSelector(["standard", "threaded", "streams"], timed_rounds=4)
    times = {"standard": [0.5, 0.010, 0.012, 0.030, 0.030], "threaded": [0.5, 0.0115, 0.0118],
             "streams": [0.5] + [0.008] * 4}  # each candidate's warm-up step first
    while not selector.done:
        mode = selector.next_schedule()
        selector.record(mode, times[mode][selector.seen[mode]])
    text = explain(SimpleNamespace(selector=selector))
    assert text.startswith("dispatch='auto' on CUDA kept streams (launcher 'worker', placement "
                           "'block_streams', CUDA Graphs off) after 13 measuring steps. ")
    for part in (
        "standard (Keras's train step): 5 steps, median 21.0 ms, p90 30.0 ms over 4 timed steps",
        "threaded (launcher 'worker', placement 'default_stream', CUDA Graphs off): 3 steps, "
        "dropped after 2 timed steps: median 11.7 ms, not 3% below standard's 11.0 ms then",
        "streams (launcher 'worker', placement 'block_streams', CUDA Graphs off): 5 steps, "
        "median 8.0 ms, p90 8.0 ms over 4 timed steps",
    ):
        assert part in text


def test_fixed_schedules_explain_themselves():
    model = build_ctr("blocking")
    assert model.dispatch_explanation == "dispatch='blocking': that schedule runs every step"
