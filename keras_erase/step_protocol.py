"""How a `DetachBlock` call meets its model's step: thread-local handler, collector, recorder.

A `DetachBlock` does not know which model calls it nor which train step runs.
The caller tells it through three thread-local stacks, each set by a context
manager around the call:

- `collecting(model, training, evaluating)`: an `EraseModel` call is running
  and consumes the blocks' local losses (`EraseModel.__call__`). `training`
  is what a block called with `training=None` uses; `evaluating` marks a test
  step, where blocks also keep their head's prediction.
- `step_handler(handler)`: the torch ERASE step is running; a training block
  hands its whole computation to `handler.run_block(block, inputs)`.
- `recording_inputs()`: every block call records `(block, inputs)` (the
  frozen-upstream check asks which variables each block's input reads).

Example:

>>> with collecting("model", training=True):
...     current_collector(), collector_training(), collector_evaluating()
('model', True, False)
>>> current_collector() is None
True
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
    """A training call's head prediction and the block's own losses, kept for `compute_loss`."""

    def __init__(self, prediction, own_losses=None):
        self.prediction = prediction
        self.own_losses = own_losses


def current_step_handler():
    """Returns the ERASE step handler installed on this thread, or `None`."""
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def current_collector():
    """Returns the `EraseModel` whose call runs on this thread (it consumes local losses) or `None`."""
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][0] if stack else None


def _collector_setting(index, default=None):
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][index] if stack else default


def collector_training():
    """Returns the `training` value of the running collector (`None` without one)."""
    return _collector_setting(1)


def collector_evaluating():
    """Returns whether the running collector is in a test step (`False` without one)."""
    return _collector_setting(2, False)


@contextlib.contextmanager
def collecting(model, training=None, evaluating=False):
    """Marks `model` (an `EraseModel`) as the consumer of its blocks' local losses during a call.

    `training`: the value a block called with `training=None` uses (`True` in
    a train step, so that a model whose `call` has no `training` argument still
    trains its blocks). `evaluating`: a test step, where blocks also keep their
    head's prediction (inference mode) so validation losses include them.
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
    """Returns those of `weights` whose penalties this call pays: each once per model call.

    Keras counts a weight's regularizer once per step, however often its
    layer is called and however many blocks hold it (`model.losses` lists
    each weight once), and a block's add_loss values once per call. The
    first block call under the running collector that holds a weight claims
    its penalty; later calls (the same block again, or another block sharing
    the layer) do not get it. Without a collector (a block called on its
    own) every call pays all of them.

    Example:

    >>> with collecting("model", training=True):
    ...     claim_weight_penalties(["a", "b"]), claim_weight_penalties(["b", "c"])
    (['a', 'b'], ['c'])
    """
    stack = getattr(_STATE, "collectors", None)
    if not stack:
        return list(weights)
    claimed = stack[-1][3]
    mine = [w for w in weights if id(w) not in claimed]
    claimed.update(id(w) for w in mine)
    return mine


@contextlib.contextmanager
def recording_inputs():
    """Records `(block, inputs)` for every `DetachBlock` call in this thread; yields the list.

    Used by `keras_erase.frozen_upstream` to ask which variables each block's
    input depends on.
    """
    previous = getattr(_STATE, "inputs", None)
    _STATE.inputs = records = []
    try:
        yield records
    finally:
        _STATE.inputs = previous


def record_inputs(block, inputs):
    """Appends `(block, inputs)` to the records of `recording_inputs`, when one is open."""
    records = getattr(_STATE, "inputs", None)
    if records is not None:
        records.append((block, inputs))


@contextlib.contextmanager
def step_handler(handler):
    """Installs `handler` for the training calls of `DetachBlock`s in this thread.

    The handler must implement `run_block(block, inputs) -> outputs`. Used by
    `EraseModel`'s torch train step; user code does not need it.
    """
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    stack.append(handler)
    try:
        yield handler
    finally:
        stack.pop()
