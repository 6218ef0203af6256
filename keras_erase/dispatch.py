"""Torch dispatchers for the ERASE train step: when and where each block's backward runs.

Every dispatcher implements the same three calls, used by `EraseModel`'s torch
train step for each `DetachBlock` met during the forward pass:

- `run_block(block, inputs, y_true, sample_weight, scale_loss)`: runs the
  block's forward pass and local loss, launches the backward pass of
  `scale_loss(local_loss)` (which only reaches the block's own weights since the
  block's input and output are detached) and returns `(outputs, local_loss)`
  with both detached.
- `finish()`: waits for every backward launched in this step and re-raises the
  first error one of them raised (with its original traceback).
- `abort()`: like `finish()` but swallows errors (used when the step already
  failed on the main thread).

Schedules:

- `BlockingDispatcher` (`"blocking"`): the backward runs inline on the main
  thread, right after the block's forward pass.
- `ThreadedDispatcher` (`"threaded"`): the backward is submitted to one FIFO
  worker thread (submission order is execution order) which runs nothing but
  `torch.autograd.backward`; Keras state (thread-local scopes) is never touched
  from the worker. An error in the worker is re-raised by `finish()` in the
  main thread; the worker keeps serving (and is restarted if it ever died), so
  the next step works and nothing hangs. `close()` (or garbage collection of
  the dispatcher) ends the thread (`keras_erase.worker`).
- `StreamDispatcher` (`"streams"`, CUDA; in `keras_erase.streams`): each
  block's forward and backward on its own CUDA stream.

CUDA Graphs (`cuda_graphs=True`, any mode): `make_dispatcher` gives the
dispatcher a `keras_erase.cuda_graphs.CudaGraphRunner` as `graphs`; the block
forward of every mode then goes through it (captured after `graph_warmup`
eager steps per block and input signature, replayed afterwards; the backward
graph is replayed by the same `torch.autograd.backward` call, on the thread and
stream the mode uses).

Intra-op threads on CPU: OpenMP teams are per thread (see
`keras_erase.worker`); the threaded worker sets its own count itself
(`worker_threads`). With `EraseModel(intra_op_threads="auto")` the main thread
and the worker each use `threads_for_worker()` (half the cores), so the main
thread's forward and the worker's backward split the machine instead of
oversubscribing it (`keras_erase.threads`).
"""

import queue
import threading
import time

import torch

from keras_erase.config import DISPATCH_MODES  # noqa: F401 - re-exported
from keras_erase.threads import set_intra_op_threads  # noqa: F401 - re-exported
from keras_erase.threads import threads_for_worker  # noqa: F401 - re-exported
from keras_erase.worker import BackwardWorker


def _detach(structure):
    if isinstance(structure, torch.Tensor):
        return structure.detach()
    if isinstance(structure, (list, tuple)):
        return type(structure)(_detach(s) for s in structure)
    if isinstance(structure, dict):
        return {k: _detach(v) for k, v in structure.items()}
    return structure


def _tensors(structure):
    if isinstance(structure, torch.Tensor):
        return [structure]
    if isinstance(structure, (list, tuple)):
        return [t for s in structure for t in _tensors(s)]
    if isinstance(structure, dict):
        return [t for v in structure.values() for t in _tensors(v)]
    return []


def _forward(block, inputs, y_true, sample_weight):
    outputs = block.forward_layer(inputs, training=True)
    loss = block.local_objective(y_true, outputs, sample_weight)
    return outputs, loss


class Dispatcher:
    """Base class: records an optional trace of forward/backward intervals.

    Set `trace` to a list to record events: dicts with `block`, `phase`
    (`"forward"`, `"submit"` or `"backward"`), `start`, `end`
    (`time.perf_counter()` seconds) and `thread` (thread id).
    """

    name = "base"

    def __init__(self):
        self.trace = None
        # Called as `after_backward(block)` right after each block's backward, on the
        # thread (and CUDA stream) that ran it, in block order (used for the
        # torch.distributed gradient all-reduce; see `keras_erase.distributed`).
        self.after_backward = None
        # A `keras_erase.cuda_graphs.CudaGraphRunner` (set by `make_dispatcher` when
        # `cuda_graphs=True`): every mode's block forward then goes through it.
        self.graphs = None

    def _record(self, block, phase, start, end=None):
        if self.trace is not None:
            self.trace.append(
                {
                    "block": block.name,
                    "phase": phase,
                    "start": start,
                    "end": start if end is None else end,
                    "thread": threading.get_ident(),
                }
            )

    def _timed_forward(self, block, inputs, y_true, sample_weight):
        start = time.perf_counter()
        with torch.profiler.record_function(f"{block.name}/forward"):
            if self.graphs is None:
                outputs, loss = _forward(block, inputs, y_true, sample_weight)
            else:
                outputs, loss = self.graphs.forward(block, inputs, y_true, sample_weight, _forward)
        self._record(block, "forward", start, time.perf_counter())
        return outputs, loss

    def _timed_backward(self, block, loss):
        start = time.perf_counter()
        # A block whose input is not detached shares its upstream graph with the
        # main loss: keep that graph for the main backward.
        with torch.profiler.record_function(f"{block.name}/backward"):
            torch.autograd.backward(loss, retain_graph=not block.detach_input)
        self._record(block, "backward", start, time.perf_counter())
        if self.after_backward is not None:
            self.after_backward(block)

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        raise NotImplementedError

    def finish(self):
        pass

    def abort(self):
        try:
            self.finish()
        except Exception:  # the step already failed; keep its error
            pass

    def close(self):
        pass


class BlockingDispatcher(Dispatcher):
    """Backward of each block inline on the main thread, right after its forward."""

    name = "blocking"

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        outputs, loss = self._timed_forward(block, inputs, y_true, sample_weight)
        self._record(block, "submit", time.perf_counter())
        if loss.requires_grad:
            self._timed_backward(block, scale_loss(loss))
        return _detach(outputs), loss.detach()


class ThreadedDispatcher(Dispatcher):
    """Backward of each block submitted to one FIFO worker thread (pure torch autograd).

    Args:
        worker_threads: torch intra-op threads of the worker thread, set by the
            worker itself (`None`: left alone). See `keras_erase.worker`.
    """

    name = "threaded"

    def __init__(self, worker_threads=None):
        super().__init__()
        self._worker = BackwardWorker(threads=worker_threads)

    @property
    def worker_threads(self):
        return self._worker.threads

    @worker_threads.setter
    def worker_threads(self, value):
        self._worker.threads = value

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        outputs, loss = self._timed_forward(block, inputs, y_true, sample_weight)
        if loss.requires_grad:
            scaled = scale_loss(loss)
            self._record(block, "submit", time.perf_counter())
            self._worker.submit(lambda: self._timed_backward(block, scaled))
        return _detach(outputs), loss.detach()

    def finish(self):
        self._worker.wait()

    def close(self):
        self._worker.stop()


def require_cuda(what):
    """Raises a clear `ValueError` when `what` needs CUDA and torch has none."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"keras_erase: {what} needs a CUDA device, but torch.cuda.is_available() is False. "
            "Use dispatch='threaded', 'blocking', 'standard' or 'auto' on CPU."
        )


def make_dispatcher(
    mode, num_streams=4, cuda_graphs=False, graph_capture=None, graph_warmup=None,
    worker_threads=None,
):
    """Builds the dispatcher for a concrete mode (`"blocking"`, `"threaded"` or `"streams"`).

    With `cuda_graphs=True` the dispatcher (any mode) gets a
    `keras_erase.cuda_graphs.CudaGraphRunner` as `dispatcher.graphs`, capturing
    with `graph_capture` (default: `cuda_graphs.default_capture()`, which
    raises `require_cuda`'s error without CUDA) after
    `graph_warmup` eager steps per block and input signature.
    `worker_threads`: intra-op threads of the `"threaded"` worker thread.
    """
    if mode == "blocking":
        dispatcher = BlockingDispatcher()
    elif mode == "threaded":
        dispatcher = ThreadedDispatcher(worker_threads=worker_threads)
    elif mode == "streams":
        from keras_erase.streams import StreamDispatcher

        dispatcher = StreamDispatcher(num_streams=num_streams)
    else:
        raise ValueError(
            f"Unknown dispatch mode {mode!r}; expected 'blocking', 'threaded' or 'streams'."
        )
    if cuda_graphs:
        from keras_erase.cuda_graphs import DEFAULT_WARMUP
        from keras_erase.cuda_graphs import CudaGraphRunner

        warmup = DEFAULT_WARMUP if graph_warmup is None else graph_warmup
        dispatcher.graphs = CudaGraphRunner(capture=graph_capture, warmup=warmup)
    return dispatcher


def __getattr__(name):  # `dispatch.StreamDispatcher` lives in `keras_erase.streams`
    if name == "StreamDispatcher":
        from keras_erase.streams import StreamDispatcher

        return StreamDispatcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
