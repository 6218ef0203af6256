"""CUDA Graphs replay on the right streams (torch, CPU stand-ins).

- Each block is captured on its own capture stream, and its last eager
  warm-up step runs on that stream (its lazy per-stream state, e.g. the cuBLAS
  workspace, then exists before the capture, outside the graph's pool).
- Nothing of the capture-time autograd graph survives the capture but the
  detached static outputs: replays accumulate the weights' gradients through
  AccumulateGrad nodes made at replay time (a node's stream is fixed when it is
  made), never through the capture-time ones.
- `CudaGraphCapture` (against a fake `torch.cuda`) captures on the stream it is
  given, makes that stream's cuBLAS handle before `capture_begin`, and its
  warm-up scope orders the caller's stream around the body.
"""

import contextlib

import numpy as np
import pytest

from keras_erase.config import Schedule
from tests.backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="CUDA Graphs are torch's")


class SpyingCapture:
    """A `RecordingCapture` that hooks the AccumulateGrad nodes of every captured forward's graph."""

    def __init__(self):
        from keras_erase.torch.cuda_graphs.capture import RecordingCapture

        self.inner = RecordingCapture()
        self.hooked = 0
        self.capture_time_accumulations = []

    def new_stream(self):
        return self.inner.new_stream()

    def warmup_scope(self, stream, tensors=()):
        return self.inner.warmup_scope(stream, tensors)

    def __call__(self, fn, pool=None, stream=None):
        def hooked_region():
            outputs = fn()
            loss = outputs[-1] if isinstance(outputs, tuple) and outputs else None
            if loss is not None and getattr(loss, "grad_fn", None) is not None:
                for node in _accumulators(loss.grad_fn):  # the capture-time accumulators
                    node.register_hook(
                        lambda *_: self.capture_time_accumulations.append(1)
                    )
                    self.hooked += 1
            return outputs

        return self.inner(hooked_region, pool, stream=stream)


def _accumulators(root):
    seen, stack, found = {}, [root], []  # the nodes kept alive: their ids stay theirs
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == "AccumulateGrad":
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


@pytest.mark.parametrize("mode", ["blocking", "threaded", "inline_streams", "streams"])
def test_replays_never_accumulate_through_the_capture_time_graph(mode):
    from keras_erase.torch import schedules
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
    from tests.erase.fake_streams import CheckedStreams
    from tests.erase.test_cuda_graphs import batches, make_block, sgd_, zero_

    schedule_run = schedules.make_schedule_run(Schedule.from_name(mode), streams=CheckedStreams())
    capture = SpyingCapture()
    schedule_run.graphs = CudaGraphRunner(capture=capture, warmup=1)
    blocks = [make_block(), make_block(seed=2, name="other")]
    weights = [w for b in blocks for w in b.trainable_weights]
    for x, y, sw in batches(6):
        zero_(weights)
        for block in blocks:
            schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.final_backward(None)
        assert all(w.value.grad is not None for w in weights)  # replays accumulated
        sgd_(weights)
    schedule_run.close()
    runner = schedule_run.graphs
    assert runner.captures == 2 and runner.backward_replays == 2 * 5 and not runner.disabled
    assert capture.hooked == 2 * 6  # the check can fail: every weight's node was hooked
    assert capture.capture_time_accumulations == []


def test_each_block_has_its_own_capture_stream_and_warms_up_on_it():
    from keras_erase.torch import schedules
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
    from tests.erase.test_cuda_graphs import batches, make_block

    schedule_run = schedules.make_schedule_run(Schedule.from_name("threaded"))
    capture = RecordingCapture()
    schedule_run.graphs = runner = CudaGraphRunner(capture=capture, warmup=2)
    blocks = [make_block(), make_block(seed=2, name="other")]
    for x, y, sw in batches(4):
        for block in blocks:
            schedule_run.run_block(block, x, y, sw, lambda v: v)
        schedule_run.finish()
    schedule_run.close()
    assert runner.captures == 2
    forward_a, backward_a, forward_b, backward_b = capture.streams
    assert forward_a is backward_a and forward_b is backward_b and forward_a is not forward_b
    assert forward_a is not None
    # The last eager warm-up step of each block ran on that block's capture stream.
    assert capture.warmups == [forward_a, forward_b]


def test_the_static_outputs_hold_no_autograd_graph():
    from tests.erase.test_cuda_graphs import batches, train_block

    _, _, schedule_run, _ = train_block("blocking", True, batches(3), close=False)
    (graph,) = schedule_run.graphs._graphs.values()
    assert all(o.grad_fn is None for o in graph.forward.outputs)
    schedule_run.close()


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _Graph:
    def __init__(self, log):
        self.log = log

    def capture_begin(self, *pool, capture_error_mode="global"):
        self.log.append(("capture_begin",))

    def capture_end(self):
        self.log.append(("capture_end",))

    def replay(self):
        pass

    def pool(self):
        return "pool"

    def reset(self):
        pass


def test_cuda_capture_uses_the_given_stream_and_makes_its_cublas_state_first(monkeypatch):
    import torch

    from keras_erase.torch.cuda_graphs import capture as graph_capture

    log, state = [], {}
    main = _Stream(log, "main")
    made = iter(range(10))
    monkeypatch.setattr(torch.cuda, "Stream", lambda: _Stream(log, f"side{next(made)}"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _Graph(log))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: state.get("current", main))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: state.__setitem__("current", s))
    monkeypatch.setattr(
        torch.cuda, "current_blas_handle",
        lambda: log.append(("blas_handle", state.get("current", main).name)),
    )

    @contextlib.contextmanager
    def use(stream):
        previous = state.get("current", main)
        state["current"] = stream
        try:
            yield
        finally:
            state["current"] = previous

    monkeypatch.setattr(torch.cuda, "stream", use)
    capture = graph_capture.CudaGraphCapture()
    block_stream = capture.new_stream()
    with capture.warmup_scope(block_stream, [np.ones(1)]) as to_caller:
        assert state["current"] is block_stream
        to_caller([])
    assert state.get("current", main) is main
    assert log[:2] == [("wait_stream", block_stream.name, "main"), ("blas_handle", block_stream.name)]
    assert log[-1] == ("wait_stream", "main", block_stream.name)
    del log[:]
    done = capture(lambda: state["current"].name, stream=block_stream)
    assert done.outputs == block_stream.name  # captured on the block's stream
    begin = log.index(("capture_begin",))
    assert ("blas_handle", block_stream.name) in log[:begin]
    assert state.get("current", main) is main
