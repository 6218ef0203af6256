"""The ERASE schedules (torch): when and where each block's backward runs.

One module per schedule, each a dispatcher class; `make_dispatcher` builds the
one a mode names. Every dispatcher (base class `base.Dispatcher`)
implements the same calls, used by `EraseModel`'s torch train step for each
`DetachBlock` met during the forward pass:

- `run_block(block, inputs, y_true, sample_weight, scale_loss)`: runs the
  block's forward pass and local loss, launches the backward pass of
  `scale_loss(local_loss)` and returns `(outputs, local_loss)` with both
  detached. That backward ends at the block's input: a `detach_input=False`
  block's input gradient is handed over (`keras_erase.torch.handoff`), so it
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

- `blocking.BlockingDispatcher` (`"blocking"`): the backward runs inline on
  the main thread, right after the block's forward pass.
- `threaded.ThreadedDispatcher` (`"threaded"`): the backward is submitted to
  one FIFO worker thread (submission order is execution order) which runs nothing but
  `torch.autograd.backward`; Keras state (thread-local scopes) is never touched
  from the worker. An error in the worker is re-raised by `finish()` in the
  main thread; the worker keeps serving (and is restarted if it ever died), so
  the next step works and nothing hangs. `close()` (or garbage collection of
  the dispatcher) ends the thread (`threaded.BackwardWorker`).
- `streams.StreamDispatcher` (`"streams"`, CUDA): each block's forward and
  backward on its own CUDA stream.

CUDA Graphs (`cuda_graphs=True`, any mode): `make_dispatcher` gives the
dispatcher a `CudaGraphRunner` (`keras_erase.torch.cuda_graphs.runner`) as
`graphs`; the block forward of every mode then goes through it (captured after `graph_warmup`
eager steps per block and input signature, replayed afterwards; the backward
graph is replayed by the same `torch.autograd.backward` call, on the thread and
stream the mode uses).

Intra-op threads on CPU: OpenMP teams are per thread (see
`threaded.BackwardWorker`); the threaded worker sets its own count itself
(`worker_threads`). With `EraseModel(intra_op_threads="auto")` the main thread
and the worker each use `threads_for_worker()` (half the cores), so the main
thread's forward and the worker's backward split the machine instead of
oversubscribing it (`keras_erase.torch.threads`).
"""

from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
from keras_erase.torch.schedules.blocking import BlockingDispatcher
from keras_erase.torch.schedules.streams import StreamDispatcher
from keras_erase.torch.schedules.threaded import ThreadedDispatcher

__all__ = ["make_dispatcher"]


def make_dispatcher(
    mode, num_streams=4, cuda_graphs=False, graph_capture=None, graph_warmup=None,
    worker_threads=None,
):
    """Builds the dispatcher for a concrete mode (`"blocking"`, `"threaded"` or `"streams"`).

    With `cuda_graphs=True` the dispatcher (any mode) gets a
    `CudaGraphRunner` as `dispatcher.graphs`, capturing with `graph_capture`
    (default: `keras_erase.torch.cuda_graphs.capture.default_capture()`, which
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
            "make_dispatcher: `mode` must be 'blocking', 'threaded' or 'streams'. "
            f"Received: mode={mode!r}"
        )
    if cuda_graphs:
        warmup = DEFAULT_WARMUP if graph_warmup is None else graph_warmup
        dispatcher.graphs = CudaGraphRunner(capture=graph_capture, warmup=warmup)
    return dispatcher

