"""Torch dispatchers for the ERASE train step: when and where each block's backward runs.

Every dispatcher (base class `keras_erase.block_dispatcher.Dispatcher`)
implements the same calls, used by `EraseModel`'s torch train step for each
`DetachBlock` met during the forward pass:

- `run_block(block, inputs, y_true, sample_weight, scale_loss)`: runs the
  block's forward pass and local loss, launches the backward pass of
  `scale_loss(local_loss)` and returns `(outputs, local_loss)` with both
  detached. That backward ends at the block's input: a `detach_input=False`
  block's input gradient is handed over (`keras_erase.handoff`), so it
  reaches only the block's own weights.
- `final_backward(main_loss)`: waits for every block backward launched in
  this step, then runs one backward of the main loss and of the shared
  upstream with the handed-over input gradients (the upstream's backward runs
  once per step in every schedule).
- `finish()`: waits for every backward launched in this step and re-raises the
  first error one of them raised (with its original traceback).
- `abort()`: like `finish()` but swallows errors (used when the step already
  failed on the main thread).
- `close()`: ends the worker thread and drops the block graphs.

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

import time

from keras_erase.block_dispatcher import Dispatcher
from keras_erase.block_dispatcher import forward_block
from keras_erase.config import DISPATCH_MODES  # noqa: F401 - re-exported
from keras_erase.streams import StreamDispatcher
from keras_erase.threads import set_intra_op_threads  # noqa: F401 - re-exported
from keras_erase.threads import threads_for_worker  # noqa: F401 - re-exported
from keras_erase.torch_tensors import detach_tensors
from keras_erase.torch_tensors import require_cuda  # noqa: F401 - re-exported
from keras_erase.worker import BackwardWorker

__all__ = [
    "BlockingDispatcher", "Dispatcher", "StreamDispatcher", "ThreadedDispatcher",
    "forward_block", "make_dispatcher",
]


class BlockingDispatcher(Dispatcher):
    """Backward of each block inline on the main thread, right after its forward."""

    name = "blocking"

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        outputs, loss, cuts = self._timed_forward(block, inputs, y_true, sample_weight)
        self._record(block, "submit", time.perf_counter())
        if loss.requires_grad:
            self._timed_backward(block, scale_loss(loss), cuts)
        return detach_tensors(outputs), loss.detach()


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
        outputs, loss, cuts = self._timed_forward(block, inputs, y_true, sample_weight)
        if loss.requires_grad:
            scaled = scale_loss(loss)
            self._record(block, "submit", time.perf_counter())
            self._worker.submit(lambda: self._timed_backward(block, scaled, cuts))
        return detach_tensors(outputs), loss.detach()

    def _wait(self):
        self._worker.wait()

    def close(self):
        self._worker.stop()
        super().close()


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

