"""The ERASE GPU path, proven on CPU: capture-safe local losses, CUDA-Graph capture logic
(through the pluggable `RecordingCapture`), graphs in every early-backward mode, the
stream schedule_run (fake stream API), capture failures, and CUDA-only checks (skipped
without CUDA)."""

import contextlib
import logging

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock
from keras_erase.config import Schedule
from tests.backend_utils import BACKEND, to_numpy

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the ERASE GPU path is torch's")


def _cuda():
    if BACKEND != "torch":
        return False
    import torch

    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs CUDA (scripts/gpu_check.sh)")


@contextlib.contextmanager
def stand_in_captures():
    """`cuda_graphs=True` captures with `RecordingCapture` on this CPU machine; yields them."""
    from keras_erase.torch.cuda_graphs import capture as graph_capture

    captures = []

    def factory():
        captures.append(graph_capture.RecordingCapture())
        return captures[-1]

    previous = graph_capture.set_default_capture(factory)
    try:
        yield captures
    finally:
        graph_capture.set_default_capture(previous)

LOSSES = [
    keras.losses.BinaryCrossentropy(from_logits=True),
    keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum"),
    keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    keras.losses.MeanAbsoluteError(reduction="none"),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "mse",
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda l: getattr(l, "name", str(l)) + "-"
                         + str(getattr(l, "reduction", "")))
@pytest.mark.parametrize("weights", [None, "rank1", "rank2"])
def test_capture_safe_loss_matches_keras_loss_call(loss, weights, rng):
    """`DetachBlock.local_loss` gives Keras's `Loss.__call__` numbers (every backend)."""
    from keras_erase.capture_safe import capture_safe_loss
    from keras_erase.loss_arguments import to_loss_object

    loss = to_loss_object(loss)
    sparse = isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
    y_pred = rng.normal(size=(6, 3 if sparse else 1)).astype("float32")
    y_true = (rng.integers(0, 3, size=(6, 1)) if sparse else rng.integers(0, 2, size=(6, 1)))
    y_true = y_true.astype("float32")
    sample_weight = {None: None, "rank1": rng.random(6), "rank2": rng.random((6, 1))}[weights]
    if sample_weight is not None:
        sample_weight = sample_weight.astype("float32")
    expected = to_numpy(loss(y_true, y_pred, sample_weight=sample_weight))
    got = to_numpy(capture_safe_loss(loss, y_true, y_pred, sample_weight))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    block = DetachBlock(keras.layers.Dense(1), loss=loss, loss_weight=0.5)
    np.testing.assert_allclose(
        to_numpy(block.local_loss(y_true, y_pred, sample_weight)),
        0.5 * expected.astype("float32"),
        rtol=1e-6,
        atol=1e-7,
    )


def test_capture_safe_loss_keeps_keras_masking(rng):
    """Masked predictions or per-sample values with a mask take Keras's own (masked) path."""
    from keras.src.backend.common.masking import set_keras_mask

    from keras_erase.capture_safe import capture_safe_loss

    class MaskingLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            values = keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
            set_keras_mask(values, keras.ops.convert_to_tensor([True, False, True, True]))
            return values

    y_true = rng.normal(size=(4, 2)).astype("float32")
    y_pred = rng.normal(size=(4, 2)).astype("float32")
    loss = MaskingLoss()
    expected = to_numpy(loss(y_true, y_pred))
    np.testing.assert_allclose(to_numpy(capture_safe_loss(loss, y_true, y_pred)), expected, rtol=1e-6)
    unmasked = to_numpy(keras.losses.MeanSquaredError()(y_true, y_pred))
    assert abs(float(expected) - float(unmasked)) > 1e-4  # the mask matters here


# -- helpers (torch) ----------------------------------------------------------------------


def _tensor(array):
    """`array` as a tensor on Keras's device (where Keras builds the blocks: CUDA on a GPU)."""
    return keras.ops.convert_to_tensor(np.asarray(array))


def keras_device():
    """The device Keras puts new tensors and variables on (`cpu`, or `cuda:0` on a GPU)."""
    return keras.ops.zeros(()).device


def make_block(seed=1, detach_input=True, layer=None, name="block"):
    keras.utils.set_random_seed(seed)
    layer = layer or keras.Sequential([keras.layers.Dense(8, "relu"), keras.layers.Dense(4)])
    block = DetachBlock(
        layer,
        head=keras.layers.Dense(1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        loss_weight=0.5,
        detach_input=detach_input,
        name=name,
    )
    block.build((None, 5))
    return block


def batches(n=5, batch=6, width=5, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            _tensor(rng.normal(size=(batch, width)).astype("float32")),
            _tensor(rng.integers(0, 2, size=(batch, 1)).astype("float32")),
            _tensor(rng.random(batch).astype("float32")),
        )
        for _ in range(n)
    ]


def sgd_(weights, lr=0.1):
    import torch

    with torch.no_grad():
        for v in weights:
            if v.value.grad is not None:
                v.value.sub_(lr * v.value.grad)


def zero_(weights):
    for v in weights:
        v.value.grad = None


def _stream_base():
    """On CUDA a fake stream is also a real (unused) stream: `record_stream` accepts it."""
    if _cuda():
        import torch

        return torch.cuda.Stream
    return object


class FakeStream(_stream_base()):
    def __new__(cls, log, name):
        return super().__new__(cls)

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))


class FakeStreams:
    """The stream API of `BlockStreams` on CPU: records every wait and event."""

    def __init__(self, device=None):
        import contextlib

        import torch

        self.device = torch.device(device or keras_device())
        self.log = []
        self.main = FakeStream(self.log, "main")
        self.current = self.main
        self._count = 0
        self._contextlib = contextlib

    def new_stream(self):
        self._count += 1
        return FakeStream(self.log, f"s{self._count}")

    def current_stream(self):
        return self.current

    def new_event(self):
        self._count += 1
        return FakeEvent(self.log, f"e{self._count}")

    def use(self, stream):
        @self._contextlib.contextmanager
        def scope():
            previous, self.current = self.current, stream
            self.log.append(("enter", stream.name))
            try:
                yield
            finally:
                self.current = previous
                self.log.append(("exit", stream.name))

        return scope()


def make_schedule_run(mode, graphs, device_capture=False):
    """`mode`'s schedule_run; with `graphs`, a runner over the stand-in capture (`device_capture`:
    real CUDA Graphs, on a GPU only)."""
    from keras_erase.torch import schedules
    from keras_erase.torch.cuda_graphs.capture import CudaGraphCapture
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
    schedule = Schedule.from_name(mode)
    schedule_run = (
        schedules.make_schedule_run(Schedule("inline", "block_streams"), num_streams=2,
                                  streams=FakeStreams())
        if mode == "streams"
        else schedules.make_schedule_run(schedule)
    )
    capture = None
    if graphs:
        capture = CudaGraphCapture() if device_capture else RecordingCapture()
        schedule_run.graphs = CudaGraphRunner(capture=capture, warmup=1)
    return schedule_run, capture


def train_block(mode, graphs, data=None, detach_input=True, close=True):
    """Trains one block (or, with detach_input=False, an upstream Dense + block) by hand.

    `close`: close the schedule_run at the end (which drops its graphs)."""
    block = make_block(detach_input=detach_input)
    upstream = None
    if not detach_input:
        keras.utils.set_random_seed(7)
        upstream = keras.layers.Dense(5)
        upstream.build((None, 5))
    weights = block.trainable_weights + (upstream.trainable_weights if upstream else [])
    schedule_run, capture = make_schedule_run(mode, graphs)
    losses = []
    for x, y, sw in data or batches():
        zero_(weights)
        inputs = upstream(x) if upstream is not None else x
        _, loss = schedule_run.run_block(block, inputs, y, sw, lambda value: value)
        schedule_run.final_backward(None)  # the upstream's backward (hand-off)
        losses.append(float(loss))
        sgd_(weights)
    if close:
        schedule_run.close()
    return [to_numpy(v) for v in weights], losses, schedule_run, capture


# -- no host data and no host sync in the captured region -------------------------------


def record_block_step(block, x, y, sw):
    """Op names of one block step (forward, local loss, backward) as the runner captures it."""
    import torch

    from keras_erase.torch.schedules.base import forward_block
    from tests.backend_utils import TorchOpRecorder

    recorder = TorchOpRecorder()
    with recorder:
        _, loss = forward_block(block, x, y, sw)
        torch.autograd.grad(loss, [v.value for v in block.trainable_weights], allow_unused=True)
    return recorder.ops


@torch_only
@pytest.mark.slow
def test_block_step_has_no_host_data_and_no_host_sync():
    from examples.ctr.model import Tower
    from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops

    x, y, sw = batches(1)[0]
    assert forbidden_ops(record_block_step(make_block(), x, y, sw)) == []
    assert forbidden_ops(record_block_step(make_block(), x, y, None)) == []
    # The CTR example's towers (e.g. the dot interaction must not index with numpy per call).
    rng = np.random.default_rng(0)
    features = _tensor(rng.normal(size=(4, 13 + 26 * 4)).astype("float32"))
    for kind in ("dot_interaction", "cross_network", "factorization_machine"):
        tower = DetachBlock(Tower(kind, width=8, embedding_dim=4, depth=2), head=keras.layers.Dense(1),
                            loss=keras.losses.BinaryCrossentropy(from_logits=True), name=kind)
        tower.build(tuple(features.shape))
        assert forbidden_ops(record_block_step(tower, features, y[:4], None)) == [], kind


@torch_only
def test_keras_loss_call_would_break_capture():
    """The control: Keras's `Loss.__call__` makes a tensor from the shape (why local_loss avoids it)."""
    from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops
    from tests.backend_utils import TorchOpRecorder

    x, y, sw = batches(1)[0]
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    recorder = TorchOpRecorder()
    with recorder:
        loss(y, x[:, :1], sample_weight=sw)
    assert "lift_fresh" in forbidden_ops(recorder.ops)


@torch_only
def test_recording_capture_refuses_host_data_and_syncs():
    import torch

    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.op_recording import CaptureRefused

    x = torch.ones(3)
    for region in (lambda: x * torch.tensor(2.0), lambda: x.sum().item(), lambda: x.nonzero()):
        with pytest.raises(CaptureRefused):
            RecordingCapture()(region)
    capture = RecordingCapture()
    done = capture(lambda: x * 2.0 + 1.0)
    x.fill_(3.0)  # new data in the static input, as a graph sees it
    done.replay()
    assert done.outputs.tolist() == [7.0, 7.0, 7.0]
    assert capture.replays == 1


# -- graphs in every mode give the eager gradients ----------------------------------------


@torch_only
@pytest.mark.parametrize("mode", ["blocking", "threaded", "streams"])
@pytest.mark.parametrize("detach_input", [True, False])
def test_graphs_give_eager_weights_in_every_mode(mode, detach_input):
    data = batches()
    eager, eager_losses, _, _ = train_block(mode, False, data, detach_input)
    graphed, graphed_losses, schedule_run, capture = train_block(mode, True, data, detach_input)
    runner = schedule_run.graphs
    assert not runner.disabled, runner.disabled_reason
    assert (runner.captures, runner.replays, runner.backward_replays) == (1, 4, 4)
    assert len(capture.captured) == 2  # the forward and the backward graph
    np.testing.assert_allclose(graphed_losses, eager_losses, rtol=1e-6)
    for a, b in zip(graphed, eager):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if not detach_input:  # the upstream layer trains through the replayed input gradient
        keras.utils.set_random_seed(7)
        upstream = keras.layers.Dense(5)
        upstream.build((None, 5))
        assert np.abs(graphed[-2] - to_numpy(upstream.kernel)).max() > 1e-4


@torch_only
@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_graphs_add_no_batch_norm_update(mode):
    """Warm-up steps are real steps and capture runs nothing: moving statistics match eager."""
    def train(graphs):
        keras.utils.set_random_seed(4)  # before the layer: Keras draws initializer seeds here
        layer = keras.Sequential(
            [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(4)]
        )
        block = make_block(layer=layer)
        schedule_run, _ = make_schedule_run(mode, graphs)
        for x, y, sw in batches(4):
            zero_(block.trainable_weights)
            schedule_run.run_block(block, x, y, sw, lambda v: v)
            schedule_run.finish()
            sgd_(block.trainable_weights)
        schedule_run.close()
        return block, schedule_run

    eager, _ = train(False)
    graphed, schedule_run = train(True)
    assert schedule_run.graphs.captures == 1 and schedule_run.graphs.replays == 3
    moving = [v for v in graphed.weights if "moving" in v.path]
    assert len(moving) == 2
    for a, b in zip(graphed.weights, eager.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6, atol=1e-7, err_msg=a.path)


@torch_only
def test_each_block_has_its_own_memory_pool_shared_only_with_its_backward():
    """A pool may only be shared by graphs replayed in capture order: never across blocks."""
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    schedule_run, _ = make_schedule_run("threaded", graphs=False)
    capture = RecordingCapture()
    schedule_run.graphs = CudaGraphRunner(capture=capture, warmup=0)
    blocks = [make_block(), make_block(seed=2, name="other")]
    x, y, sw = batches(1)[0]
    for block in blocks:
        schedule_run.run_block(block, x, y, sw, lambda v: v)
    schedule_run.finish()
    schedule_run.close()
    forward_a, backward_a, forward_b, backward_b = capture.pools
    assert backward_a is forward_a and backward_b is forward_b and forward_a is not forward_b


@torch_only
def test_freezing_a_layer_after_capture_captures_again():
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    block = make_block()
    schedule_run, _ = make_schedule_run("blocking", graphs=False)
    schedule_run.graphs = runner = CudaGraphRunner(capture=RecordingCapture(), warmup=0)
    data = batches(4)
    for x, y, sw in data[:2]:
        schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.finish()  # one step each
    assert runner.captures == 1
    block.head.trainable = False
    for x, y, sw in data[2:]:
        zero_(block.weights)
        schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.finish()
    assert runner.captures == 2 and not runner.disabled
    assert block.head.kernel.value.grad is None  # frozen: no gradient from the new graph
    assert block.layer.weights[0].value.grad is not None


@torch_only
def test_graph_capture_keeps_the_inputs_requires_grad():
    """A detach_input=False block's static inputs require grad like the real ones."""
    import torch

    _, _, schedule_run, _ = train_block(
        "blocking", True, batches(3), detach_input=False, close=False
    )
    (graph,) = schedule_run.graphs._graphs.values()
    assert graph.static_inputs[0].requires_grad
    assert graph.grad_slots[0] == 0 and graph.grad_slots[1:] == [None, None]
    assert isinstance(graph.backward.outputs[0], torch.Tensor)


@torch_only
def test_block_streams_orders_streams_and_moves_cpu_batches(monkeypatch):
    """Batches are moved to the schedule_run's device; record_stream only on CUDA tensors."""
    import torch

    from keras_erase.torch import tensors
    from keras_erase.torch.schedules import placements

    moved = []
    real_to_device = tensors.to_device

    def spy(structure, device):
        moved.append(device)
        return real_to_device(structure, device)

    monkeypatch.setattr(placements, "to_device", spy)
    schedule_run, _ = make_schedule_run("streams", graphs=False)
    block = make_block()
    x, y, sw = batches(1)[0]
    outputs, loss = schedule_run.run_block(block, x, y, sw, lambda v: v)
    schedule_run.finish()
    assert moved == [torch.device(keras_device())]
    log = [entry for entry in schedule_run.placement.api.log]
    s = schedule_run.placement.streams[0].name
    assert log[0] == ("wait_stream", s, "main")  # the block stream waits for its inputs
    record = next(i for i, e in enumerate(log) if e[0] == "record")
    wait = next(i for i, e in enumerate(log) if e[0] == "wait_event")
    exit_ = log.index(("exit", s))
    assert record < exit_ < wait and log[wait][2] == log[record][1]
    assert log[-1] == ("wait_stream", "main", s)  # finish(): main waits for the block stream
    assert block.trainable_weights[0].value.grad is not None
    # to_device really moves (the meta device stands in for CUDA on a CPU machine).
    assert real_to_device({"y": y}, "meta")["y"].device.type == "meta"
    if not x.is_cuda:
        placements.protect([x, y], object())  # CPU tensors: no record_stream (would raise here)


# -- capture failures ---------------------------------------------------------------------


@torch_only
def test_a_capture_failure_disables_graphs_for_the_run_logged_once(caplog):
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    data = batches()
    eager, _, _, _ = train_block("blocking", False, data)
    schedule_run, _ = make_schedule_run("blocking", graphs=False)
    schedule_run.graphs = runner = CudaGraphRunner(capture=RecordingCapture(fail_after=1), warmup=1)
    blocks = [make_block(), make_block(seed=2, name="other")]
    with caplog.at_level(logging.WARNING, logger="keras_erase"):
        for x, y, sw in data:
            for block in blocks:
                zero_(block.trainable_weights)
                schedule_run.run_block(block, x, y, sw, lambda v: v)
                schedule_run.finish()
                sgd_(block.trainable_weights)
    assert runner.disabled and runner.failures == 1 and runner.captures == 0
    assert "injected capture failure" in runner.disabled_reason
    assert sum("CUDA Graphs disabled" in r.getMessage() for r in caplog.records) == 1
    for a, b in zip([to_numpy(v) for v in blocks[0].trainable_weights], eager):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@torch_only
def test_a_failure_after_other_captures_sends_every_block_back_to_eager():
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    schedule_run, _ = make_schedule_run("blocking", graphs=False)
    capture = RecordingCapture(fail_after=3)  # block A's two graphs succeed, block B's fails
    schedule_run.graphs = runner = CudaGraphRunner(capture=capture, warmup=0)
    blocks = [make_block(), make_block(seed=2, name="other")]
    replays = []
    for x, y, sw in batches(3):
        for block in blocks:
            schedule_run.run_block(block, x, y, sw, lambda v: v)
        replays.append(runner.replays)
    assert runner.captures == 1 and runner.failures == 1 and runner.disabled
    assert replays == [1, 1, 1]  # block A's graph is not used after the failure
    assert runner._graphs == {}


@torch_only
def test_a_block_with_a_host_sync_is_refused_and_trains_eagerly():
    """A region with `.item()` (like Keras's seeded Dropout) cannot be captured: eager fallback."""
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    class Syncing(keras.layers.Layer):
        def build(self, shape):
            self.dense = keras.layers.Dense(3)
            self.dense.build(shape)

        def call(self, x):
            scale = float(keras.ops.max(keras.ops.abs(x)))  # host sync
            return self.dense(x / scale)

        def compute_output_shape(self, shape):
            return (*shape[:-1], 3)

    block = make_block(layer=Syncing())
    schedule_run, _ = make_schedule_run("blocking", graphs=False)
    schedule_run.graphs = runner = CudaGraphRunner(capture=RecordingCapture(), warmup=0)
    x, y, sw = batches(1)[0]
    _, loss = schedule_run.run_block(block, x, y, sw, lambda v: v)
    assert runner.disabled and "_local_scalar_dense" in runner.disabled_reason
    assert np.isfinite(float(loss)) and block.trainable_weights[0].value.grad is not None


@torch_only
def test_host_data_in_a_block_is_refused_before_any_capture(caplog):
    """Keras's activity_regularizer casts the batch size in every call: refused with a clear reason."""
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    layer = keras.Sequential([keras.layers.Dense(4, activity_regularizer="l2")])
    block = make_block(layer=layer)
    schedule_run, _ = make_schedule_run("blocking", graphs=False)
    capture = RecordingCapture()
    schedule_run.graphs = runner = CudaGraphRunner(capture=capture, warmup=1)
    with caplog.at_level(logging.WARNING, logger="keras_erase"):
        for x, y, sw in batches(3):
            schedule_run.run_block(block, x, y, sw, lambda v: v)
    assert runner.disabled and "aten.lift_fresh" in runner.disabled_reason
    assert "'block'" in runner.disabled_reason and capture.captured == []  # never tried
    assert sum("CUDA Graphs disabled" in r.getMessage() for r in caplog.records) == 1


@torch_only
@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_a_block_with_weight_regularizers_is_graphed_like_eager(mode):
    """Weight penalties are part of the captured local objective (no host data): same weights."""
    def train(graphs):
        keras.utils.set_random_seed(4)
        layer = keras.Sequential([
            keras.layers.Dense(8, "relu", kernel_regularizer=keras.regularizers.L2(0.5)),
            keras.layers.Dense(4, bias_regularizer=keras.regularizers.L1L2(0.1, 0.2)),
        ])
        return train_block_with(layer, mode, graphs)

    eager, _ = train(False)
    graphed, runner = train(True)
    assert runner.captures == 1 and not runner.disabled, runner.disabled_reason
    for a, b in zip(graphed, eager):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def train_block_with(layer, mode, graphs, steps=4, torch_seed=None, device_capture=False):
    """Trains `make_block(layer=layer)` by hand; returns its weights and the graph runner.

    `torch_seed`: torch's generators seeded once the block is built (the same draws follow).
    `device_capture`: real CUDA Graphs (a GPU), else the stand-in capture.
    """
    import torch

    block = make_block(layer=layer)
    schedule_run, _ = make_schedule_run(mode, graphs, device_capture)
    if torch_seed is not None:
        torch.manual_seed(torch_seed)
    for x, y, sw in batches(steps):
        zero_(block.trainable_weights)
        schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.finish()
        sgd_(block.trainable_weights)
    schedule_run.close()
    return [to_numpy(v) for v in block.weights], schedule_run.graphs


class _FakeCudaGraph:
    fail_in = None

    def __init__(self):
        self.calls = []

    def capture_begin(self, *pool, capture_error_mode="global"):
        self.calls.append(("begin", capture_error_mode))
        if self.fail_in == "begin":
            raise RuntimeError("capture_begin failed")

    def capture_end(self):
        self.calls.append(("end",))
        if self.fail_in in ("end", "region"):
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):
        pass

    def pool(self):
        return "pool"

    def reset(self):
        self.calls.append(("reset",))


@torch_only
@pytest.mark.parametrize("fail_in", [None, "begin", "region", "end"])
def test_cuda_capture_uses_thread_local_mode_and_restores_the_stream(monkeypatch, fail_in):
    """On CPU: `CudaGraphCapture` against a fake `torch.cuda` (stream restored in `finally`)."""
    import torch

    from keras_erase.torch.cuda_graphs import capture as graph_capture

    state = {"stream": "main"}
    graphs = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            pass

    def new_graph():
        graph = _FakeCudaGraph()
        graph.fail_in = fail_in
        graphs.append(graph)
        return graph

    main = Stream("main")
    routed = []
    monkeypatch.setattr(graph_capture, "end_pool_routing", routed.append)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: state.get("current", main))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: state.__setitem__("current", s))
    capture = graph_capture.CudaGraphCapture()

    def region():
        assert state["current"] is capture.stream  # captured on the side stream
        if fail_in == "region":
            raise RuntimeError("host sync in region")
        return "outputs"

    if fail_in is None:
        assert capture(region).outputs == "outputs"
    else:
        expected = {"begin": "capture_begin", "region": "host sync", "end": "not permitted"}
        with pytest.raises(RuntimeError, match=expected[fail_in]):
            capture(region)
    assert state["current"] is main  # restored whatever happened
    assert graphs[0].calls[0] == ("begin", "thread_local")
    # a capture that raised tells the allocator it is over (torch < 2.12 does not)
    assert routed == ([] if fail_in is None else graphs)


@torch_only
def test_ending_pool_routing_names_the_graphs_pool_and_ignores_a_pool_already_ended(monkeypatch):
    import torch

    from keras_erase.torch.cuda_graphs.capture import end_pool_routing

    calls = []

    def end(device, pool):
        calls.append((device, pool))
        if len(calls) == 2:
            raise RuntimeError("endAllocatePool: not found")  # torch had already ended it

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    graph = _FakeCudaGraph()
    end_pool_routing(graph)
    end_pool_routing(graph)
    assert calls == [(0, "pool"), (0, "pool")]


# -- the rest of the GPU plumbing ------------------------------------------------------------


@torch_only
def test_gradient_sync_builds_no_tensor_from_host_data_per_block(tmp_path):
    """A block's all-reduce launch creates its presence flags with device ops only."""
    import torch
    import torch.distributed as dist

    from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops
    from keras_erase.torch.distributed import GradientSync
    from keras_erase.torch.launch import free_port
    from tests.backend_utils import TorchOpRecorder

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        block = make_block()
        x, y, sw = batches(1)[0]
        schedule_run, _ = make_schedule_run("blocking", graphs=False)
        schedule_run.run_block(block, x, y, sw, lambda v: v)
        model = _FakeModel([block])
        sync = GradientSync()
        sync.start_step(model)
        recorder = TorchOpRecorder()
        with recorder:
            sync.block_done(block)
        assert forbidden_ops(recorder.ops) == []
        before = [v.value.grad.clone() for v in block.trainable_weights]
        sync.finish()
        for v, g in zip(block.trainable_weights, before):
            torch.testing.assert_close(v.value.grad, g)
    finally:
        dist.destroy_process_group()


class _FakeModel(keras.layers.Layer):
    """Holds the blocks as its only layers (what `GradientSync` reads of a model)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def detach_blocks(self):
        return self.blocks


@torch_only
def test_launch_picks_nccl_with_one_device_per_rank_when_cuda_is_present():
    from keras_erase.torch.launch import process_group_backend

    assert process_group_backend(cuda_devices=0, nproc=2) == ("gloo", None)
    assert process_group_backend(cuda_devices=4, nproc=2) == ("nccl", [0, 1])
    assert process_group_backend(cuda_devices=2, nproc=4) == ("gloo", None)


@torch_only
def test_graph_warmup_steps_are_untimed_for_auto():
    from keras_erase.torch.cuda_graphs.runner import untimed_steps

    assert untimed_steps(2) == 3  # two eager warm-up steps and the capture step


# -- CUDA only (scripts/gpu_check.sh runs them) ---------------------------------------------


@needs_cuda
@pytest.mark.parametrize("mode", ["blocking", "threaded", "streams"])
def test_cuda_graphs_capture_and_replay_on_gpu(mode):
    """On a GPU: a real graph is captured and replayed in every mode, with eager weights."""
    import torch

    from keras_erase.torch import schedules
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner

    def run(graphs):
        block = make_block()
        d = schedules.make_schedule_run(Schedule.from_name(mode), num_streams=2)
        if graphs:
            d.graphs = CudaGraphRunner(warmup=2)
        for x, y, sw in batches(6):
            zero_(block.trainable_weights)
            x, y, sw = x.cuda(), y.cuda(), sw.cuda()
            d.run_block(block, x, y, sw, lambda v: v)
            d.finish()
            torch.cuda.synchronize()
            sgd_(block.trainable_weights)
        d.close()
        return [to_numpy(v) for v in block.trainable_weights], d

    eager, _ = run(False)
    graphed, d = run(True)
    runner = d.graphs
    assert not runner.disabled, runner.disabled_reason
    # 6 steps: 2 eager warm-up steps, then the capture step and 3 more, all replayed
    assert runner.captures == 1 and runner.replays == 4 and runner.backward_replays == 4
    for a, b in zip(graphed, eager):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("mode", ["blocking", "threaded", "streams"])
def test_erase_model_fit_with_cuda_graphs_on_gpu(mode):
    """On a GPU: `EraseModel(cuda_graphs=True)` captures every block and trains like eager."""
    from keras_erase import EraseModel
    from keras_erase.torch.cuda_graphs import runner as graph_runner

    def build(graphs):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((5,))
        h = inputs
        for b in range(3):
            h = DetachBlock(
                keras.Sequential([keras.layers.Dense(16, "relu"), keras.layers.Dense(5)]),
                head=keras.layers.Dense(1),
                loss=keras.losses.BinaryCrossentropy(from_logits=True),
                name=f"block_{b}",
            )(h)
        model = EraseModel(inputs, keras.layers.Dense(1, "sigmoid")(h), dispatch=mode,
                           cuda_graphs=graphs, num_streams=2)
        model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (rng.random((64, 1)) < 0.4).astype("float32")
    eager = build(False)
    eager.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    before = set(map(id, graph_runner.live_runners()))
    graphed = build(True)
    graphed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    (runner,) = [r for r in graph_runner.live_runners() if id(r) not in before]
    assert not runner.disabled, runner.disabled_reason
    assert runner.captures == 3 and runner.replays == 3 * (8 - 2)
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_capture_failure_restores_the_stream_on_gpu():
    """Runs in its own process in the GPU check: a failed capture must not poison the others."""
    import torch

    from keras_erase.torch.cuda_graphs.capture import CudaGraphCapture

    capture = CudaGraphCapture()
    x = torch.ones(3, device="cuda")
    before = torch.cuda.current_stream()
    with pytest.raises(Exception):
        capture(lambda: x.sum().item())
    assert torch.cuda.current_stream() == before
    # The allocator is out of capture mode (torch < 2.12 leaves it in, pytorch#180395):
    # freeing the cache synchronises, which asserts while a capture is believed underway.
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    done = capture(lambda: x * 2)  # a later capture still works
    x.fill_(3.0)
    done.replay()
    torch.cuda.synchronize()
    assert done.outputs.tolist() == [6.0, 6.0, 6.0]


@torch_only
@pytest.mark.parametrize("mode", ["blocking", pytest.param("threaded", marks=pytest.mark.slow)])
def test_graphed_blocks_train_like_eager_under_mixed_bfloat16(mode):
    """A block's graphs are captured once and replayed against its parameters, not the
    bfloat16 copies its layers read inside their mixed-precision scope: every tower weight
    changes at every step, and graphs give the eager weights."""
    from keras_erase.config import EraseConfig
    from keras_erase.runtime import EraseRuntime
    from tests.backend_utils import dtype_policy
    from tests.erase import test_erase_handoff as handoff

    runs = {}
    for graphs in (False, True):
        with dtype_policy("mixed_bfloat16"), stand_in_captures():
            model = handoff.build(mode)
            model.__dict__["_erase"] = EraseRuntime(
                EraseConfig(dispatch=mode, cuda_graphs=graphs, intra_op_threads=None), True)
            kernels = [model.get_layer(f"tower_{i}").layer.layers[0].kernel for i in range(handoff.TOWERS)]
            changes, last = [], [to_numpy(k) for k in kernels]

            def record(batch, logs):
                now = [to_numpy(k) for k in kernels]
                changes.append(min(np.abs(a - b).max() for a, b in zip(now, last)))
                last[:] = now

            model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
            x, y = handoff.data()
            model.fit(x, y, batch_size=handoff.BATCH, epochs=2, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=record)])
        runs[graphs] = [to_numpy(w) for w in model.get_weights()], changes, model
    runner = next(iter(runs[True][2]._erase.schedule_runs.values())).graphs
    assert not runner.disabled and runner.captures == handoff.TOWERS, runner.captures
    assert min(runs[True][1]) > 0, runs[True][1]  # every tower trains at every step
    for a, b in zip(runs[True][0], runs[False][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
