"""The step protocol: how a `DetachBlock` call meets its model's step.

A block knows neither its model nor the train step; the caller tells it
through thread-local stacks, each set by a context manager:

- `collecting(model, training, evaluating)`: an `EraseModel` call runs. In a
  training or test call a block keeps its head's prediction and own losses
  as a `PendingPrediction`, which `EraseModel.compute_loss` consumes in the
  same step (`keras_erase.local_losses`);
- `step_handler(handler)`: the torch ERASE step runs; a training block hands
  its whole computation to `handler.run_block(block, inputs) -> outputs`;
- `recording_inputs()`: every block call records `(block, inputs)`
  (`keras_erase.frozen_upstream`).
"""

import contextlib
import threading

__all__ = [
    "PendingPrediction", "claim_weight_penalties", "collecting", "collector_evaluating",
    "collector_training", "current_collector", "current_step_handler", "record_inputs",
    "recording_inputs", "step_handler",
]

_STATE = threading.local()


class PendingPrediction:
    """A block call's head prediction and own losses, kept for `compute_loss`."""

    def __init__(self, prediction, own_losses=None):
        self.prediction = prediction
        self.own_losses = own_losses


def current_step_handler():
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def current_collector():
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][0] if stack else None


def _collector_setting(index, default=None):
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][index] if stack else default


def collector_training():
    return _collector_setting(1)


def collector_evaluating():
    return _collector_setting(2, False)


@contextlib.contextmanager
def collecting(model, training=None, evaluating=False):
    """Marks `model` as the consumer of its blocks' local losses during a call.

    `training`: what a block called with `training=None` uses (`True` in a
    train step, for a `call` without a `training` argument); `evaluating`: a
    test step.
    """
    stack = getattr(_STATE, "collectors", None)
    if stack is None:
        stack = _STATE.collectors = []
    stack.append((model, training, evaluating, set()))
    try:
        yield model
    finally:
        stack.pop()


def claim_weight_penalties(weights):
    """Those of `weights` whose penalties this call pays: each once per model call, as Keras counts them."""
    stack = getattr(_STATE, "collectors", None)
    if not stack:
        return list(weights)
    claimed = stack[-1][3]
    mine = [w for w in weights if id(w) not in claimed]
    claimed.update(id(w) for w in mine)
    return mine


@contextlib.contextmanager
def recording_inputs():
    """Records `(block, inputs)` for every block call in this thread; yields the list."""
    previous = getattr(_STATE, "inputs", None)
    _STATE.inputs = records = []
    try:
        yield records
    finally:
        _STATE.inputs = previous


def record_inputs(block, inputs):
    records = getattr(_STATE, "inputs", None)
    if records is not None:
        records.append((block, inputs))


@contextlib.contextmanager
def step_handler(handler):
    """Installs `handler` for the training calls of `DetachBlock`s in this thread."""
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    stack.append(handler)
    try:
        yield handler
    finally:
        stack.pop()
