"""Launcher x placement x graphs: every combination trains with the standard step's weights (torch, CPU).

The three schedule choices are independent (`keras_erase.config.Schedule`).
On this CPU machine the `"block_streams"` placement runs on `CheckedStreams`
(`tests/erase/fake_streams.py`), a stand-in that models CUDA stream ordering and
reports every race and every tensor crossing streams without `record_stream`;
CUDA Graphs run on the stand-in capture `RecordingCapture`. Models: the shared
upstream (an `Embedding` feeding three `detach_input=False` towers, with and
without a direct path to the top) and a reused tower (one block met twice
per step).
"""

import keras
import numpy as np
import pytest

from tests.backend_utils import BACKEND, to_numpy

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the ERASE schedules are torch's")

COMBINATIONS = [
    (launcher, placement, graphs)
    for launcher in ("inline", "worker")
    for placement in ("default_stream", "block_streams")
    for graphs in (False, True)
]


def _ids(combination):
    launcher, placement, graphs = combination
    return f"{launcher}-{placement}" + ("-graphs" if graphs else "")


@pytest.fixture
def stand_ins():
    """CUDA Graphs on the stand-in capture `RecordingCapture`; yields the captures made."""
    from tests.erase.test_cuda_graphs import stand_in_captures

    with stand_in_captures() as captures:
        yield captures


def reconfigure(model, **options):
    """Gives `model` a fresh ERASE runtime with `options` (as `EraseModel(**options)` would)."""
    from keras_erase.config import EraseConfig
    from keras_erase.runtime import EraseRuntime

    config = EraseConfig(intra_op_threads=None, **options)
    model.__dict__["_erase"] = EraseRuntime(config, True)
    return model


def early(model, combination):
    launcher, placement, graphs = combination
    return reconfigure(
        model, dispatch="early", launcher=launcher, placement=placement, cuda_graphs=graphs
    )


def fit_watched(model, fit, checked):
    """Runs `fit(model)`; with `checked`, on one `CheckedStreams` watching every op. Returns both."""
    from keras_erase.torch.schedules import placements
    from tests.erase.fake_streams import CheckedStreams

    if not checked:
        return fit(model), None
    streams = CheckedStreams()
    previous = placements.set_default_streams(lambda: streams)
    blocks = model.detach_blocks()
    unprotected = streams.unprotected = []

    def check_gradients(*_, **__):  # every block gradient the main stream reads was protected
        for block in blocks:
            for v in block.trainable_weights:
                grad = v.value.grad
                if grad is not None and not streams.protected(grad, "main"):
                    unprotected.append(v.path)

    model_fit = model.fit

    def fit_with_check(*args, **kwargs):
        kwargs["callbacks"] = [keras.callbacks.LambdaCallback(on_train_batch_end=check_gradients)]
        return model_fit(*args, **kwargs)

    model.fit = fit_with_check
    try:
        with streams.watching():
            weights = fit(model)
    finally:
        placements.set_default_streams(previous)
        del model.fit
    return weights, streams


def _check_streams(streams, combination, blocks):
    from keras_erase.torch.schedules.worker import NAME

    launcher, placement, _ = combination
    if placement == "default_stream":
        assert streams is None or streams.ops_on.keys() <= {"main"}
        return
    launching = {thread for thread, _ in streams.entered if thread != "MainThread"}
    assert launching == ({NAME} if launcher == "worker" else set()), launching
    assert streams.problems() == [], streams.problems()[:5]
    assert streams.unprotected == [], streams.unprotected[:5]
    busy = [name for name, count in streams.ops_on.items() if name != "main" and count > 0]
    assert len(busy) == blocks, streams.ops_on  # one stream per block, each did work
    joins = [e for e in streams.log if e[0] == "wait_stream" and e[1] == "main"]
    assert joins  # the main stream joined the block streams


@pytest.mark.parametrize("skip", [False, True], ids=["towers-only", "direct-path-too"])
@pytest.mark.parametrize("combination", COMBINATIONS, ids=_ids)
def test_shared_upstream_gets_the_standard_weights(combination, skip, stand_ins):
    from tests.erase import test_erase_handoff as handoff

    reference = handoff.fit(handoff.build("standard", skip))
    model = early(handoff.build("standard", skip), combination)
    weights, streams = fit_watched(model, handoff.fit, combination[1] == "block_streams")
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _check_streams(streams, combination, handoff.TOWERS)
    dispatcher = next(iter(model._erase.dispatchers.values()))
    assert dispatcher.name == f"{combination[0]}+{combination[1]}"
    if combination[2]:
        runner = dispatcher.graphs
        assert runner is not None and not runner.disabled, runner and runner.disabled_reason
        assert runner.captures == handoff.TOWERS and runner.replays > 0


# The whole matrix is slow; the paper's row 1 combination stays in the fast subset.
REUSED_TOWER_CASES = [
    pytest.param(c, d, id=f"{_ids(c)}-detach_input={d}",
                 marks=() if (c == ("worker", "block_streams", True) and not d) else pytest.mark.slow)
    for c in COMBINATIONS for d in (True, False)
]


@pytest.mark.parametrize("combination,detach_input", REUSED_TOWER_CASES)
def test_a_reused_tower_gets_the_standard_weights(combination, detach_input, stand_ins):
    from tests.erase import test_cuda_graphs_lifecycle as lifecycle

    x, y = lifecycle.data()

    def fit(model):
        model.fit(x, y, batch_size=lifecycle.BATCH, epochs=1, shuffle=False, verbose=0)
        return [to_numpy(w) for w in model.get_weights()]

    reference = fit(lifecycle.shared_tower_model("standard", False, detach_input))
    model = early(lifecycle.shared_tower_model("standard", False, detach_input), combination)
    weights, streams = fit_watched(model, fit, combination[1] == "block_streams")
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _check_streams(streams, combination, 1)  # one block, met twice: one stream
    if combination[2]:
        runner = next(iter(model._erase.dispatchers.values())).graphs
        assert not runner.disabled and runner.captures == 2  # a graph pair per occurrence


def test_the_stream_checker_finds_a_missing_join_and_a_missing_record_stream(stand_ins):
    """The control: a placement that skips `record_stream` or the join is caught."""
    from keras_erase.torch.schedules import placements
    from tests.erase import test_erase_handoff as handoff

    for broken in ("protect_gradients", "join"):
        model = early(handoff.build("standard"), ("worker", "block_streams", False))
        real = getattr(placements.BlockStreams, broken)
        try:
            setattr(placements.BlockStreams, broken, lambda self, *args: None)
            _, streams = fit_watched(model, lambda m: handoff.fit(m, epochs=1), True)
        finally:
            setattr(placements.BlockStreams, broken, real)
        found = streams.unprotected if broken == "protect_gradients" else streams.problems()
        assert found, broken


def test_one_stream_per_block_by_default_and_num_streams_caps_them():
    from keras_erase.torch.schedules.placements import BlockStreams
    from tests.erase.fake_streams import CheckedStreams

    blocks = [object() for _ in range(6)]
    own = BlockStreams(CheckedStreams())
    assert len({id(own.stream_for(b)) for b in blocks}) == 6
    capped = BlockStreams(CheckedStreams(), num_streams=4)
    streams = [capped.stream_for(b) for b in blocks]
    assert len({id(s) for s in streams}) == 4 and streams[4] is streams[0]
    assert own.stream_for(blocks[2]) is own.stream_for(blocks[2])


@pytest.mark.parametrize("skip", [False, True], ids=["towers-only", "direct-path-too"])
@pytest.mark.parametrize("launcher", ["inline", "worker"])
def test_the_main_loss_backward_runs_before_the_blocks_are_joined(launcher, skip, monkeypatch):
    """`final_backward`: the main loss's part first; the join only where the hand-off needs it."""
    from keras_erase.torch.schedules.base import Dispatcher
    from tests.erase import test_erase_handoff as handoff

    events = []
    real_finish = Dispatcher.finish

    def finish(self):
        events.append("join")
        return real_finish(self)

    monkeypatch.setattr(Dispatcher, "finish", finish)
    model = early(handoff.build("standard", skip), (launcher, "default_stream", False))
    top = model.get_layer("top").kernel.value
    top.register_post_accumulate_grad_hook(lambda p: events.append("top"))
    handoff.table_of(model).register_post_accumulate_grad_hook(lambda p: events.append("table"))
    handoff.fit(model, epochs=1)
    steps = handoff.N // handoff.BATCH
    assert events == ["top", "join", "table"] * steps


def test_main_backward_to_handoff_is_exact_or_declines():
    import torch

    from keras_erase.torch.schedules.main_backward import main_backward_to_handoff

    def setup():
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        v = torch.randn(3, requires_grad=True)
        return w, v, torch.sin(w)

    # The main loss reaches the upstream tensor u: its gradient at u is handed over.
    w, v, u = setup()
    handed = main_backward_to_handoff((u * v).sum() + (v * v).sum(), [u])
    assert w.grad is None and len(handed) == 1 and handed[0][0] is u
    torch.autograd.backward([u], [handed[0][1] + 1.0])  # + a block's gradient
    expected_w = torch.cos(w.detach()) * (v.detach() + 1.0)
    torch.testing.assert_close(w.grad, expected_w)
    torch.testing.assert_close(v.grad, torch.sin(w.detach()) + 2 * v.detach())
    # w also reached directly (and behind u): declined, nothing ran.
    w, v, u = setup()
    assert main_backward_to_handoff((u * v).sum() + (w * 3.0).sum(), [u]) is None
    assert w.grad is None and v.grad is None
    # w reached directly, but not through u: declined too (the upstream would run twice).
    w, v, u = setup()
    assert main_backward_to_handoff((w * v).sum(), [u]) is None and w.grad is None
    # one upstream tensor behind another: declined.
    w, v, u = setup()
    u2 = u * 2.0
    assert main_backward_to_handoff((u2 * v).sum() + u.sum(), [u, u2]) is None


def test_auto_on_cuda_measures_every_schedule_that_can_win_and_names_the_one_kept(
    stand_ins, auto_measures, monkeypatch
):
    """`dispatch="auto"` on CUDA (faked here): every launcher x placement, eager and graphed."""
    from keras_erase.auto import ScheduleSelector
    from keras_erase.torch.auto_schedule import describe_schedule
    from tests.erase import test_cuda_graphs_lifecycle as lifecycle

    fake_seconds = {"streams+graphs": 0.5}
    real_record = ScheduleSelector.record
    monkeypatch.setattr(
        ScheduleSelector, "record",
        lambda self, schedule, seconds: real_record(self, schedule, fake_seconds.get(schedule, 1.0)),
    )
    x, y = lifecycle.data()
    model = reconfigure(lifecycle.shared_tower_model("standard", False, False),
                        dispatch="auto", cuda_graphs=True, auto_steps=1)
    model.compile(keras.optimizers.SGD(0.2), "binary_crossentropy")
    model.fit(x, y, batch_size=lifecycle.BATCH, epochs=4, shuffle=False, verbose=0)
    selector = model._erase.selector
    eager = ["blocking", "threaded", "streams", "inline+block_streams"]
    assert selector.candidates == ["standard"] + eager + [f"{label}+graphs" for label in eager]
    assert all(selector.seen[c] > 0 for c in selector.candidates)
    assert selector.done and model.dispatch_choice == "streams+graphs"
    text = model.dispatch_explanation
    assert text.startswith("dispatch='auto' on CUDA kept streams+graphs (launcher 'worker', "
                           "placement 'block_streams', CUDA Graphs per block) after ")
    timings = model.auto_timings  # the numbers it was kept on, as the explanation prints them
    assert set(timings) == set(selector.candidates)
    for mode, timing in timings.items():
        seconds = fake_seconds.get(mode, 1.0)
        assert timing == {"median_s": seconds, "p90_s": seconds, "steps": 1}
        assert (f"{describe_schedule(mode)}: {selector.seen[mode]} step"
                f"{'' if selector.seen[mode] == 1 else 's'}, median {seconds * 1e3:.1f} ms, "
                f"p90 {seconds * 1e3:.1f} ms over 1 timed step") in text
    kept = model._erase.dispatchers["streams+graphs"]
    assert kept.name == "worker+block_streams" and kept.graphs.captures == 2  # two occurrences
