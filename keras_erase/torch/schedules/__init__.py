"""The ERASE schedules (torch): who launches each block's backward, where it runs, graphs or not.

A schedule is three independent choices (`keras_erase.config.Schedule`):

- launcher (`launchers.py`): `"inline"` (the main thread, right after the
  block's forward) or `"worker"` (one FIFO worker thread, `worker.py`);
- placement (`placements.py`): `"default_stream"` or `"block_streams"` (CUDA:
  the block's forward and backward on a stream of its own);
- CUDA Graphs: off, or each block captured and replayed
  (`keras_erase.torch.cuda_graphs.runner.CudaGraphRunner` as `graphs`).

`base.Dispatcher` composes a launcher and a placement; `make_dispatcher`
builds one from a preset name or a schedule label. The presets are classes
too: `blocking.BlockingDispatcher` (inline, default stream),
`threaded.ThreadedDispatcher` (worker, default stream) and
`streams.StreamDispatcher` (a stream per block; the `"streams"` preset
launches from the worker). Every dispatcher implements the same calls, used by
`EraseModel`'s torch train step for each `DetachBlock` met during the forward
pass:

- `run_block(block, inputs, y_true, sample_weight, scale_loss)`: runs the
  block's forward pass and local loss, launches the backward pass of
  `scale_loss(local_loss)` and returns `(outputs, local_loss)` with both
  detached. That backward ends at the block's input: a `detach_input=False`
  block's input gradient is handed over (`keras_erase.torch.handoff`), so it
  reaches only the block's own weights.
- `final_backward(main_loss)`: the main loss's backward down to the block
  outputs and the hand-off first, then waits for every block backward launched
  in this step and runs one backward of the shared upstream with the
  handed-over input gradients (the upstream's backward runs once per step in
  every schedule).
- `finish()`: waits for every backward launched in this step and re-raises the
  first error one of them raised (with its original traceback).
- `abort()`: like `finish()` but swallows errors (used when the step already
  failed on the main thread).
- `close()`: ends the worker thread and drops the block graphs.

A worker error is re-raised by `finish()` in the main thread; the worker keeps
serving (and is restarted if it ever died), so the next step works and nothing
hangs. Keras state (thread-local scopes) is never touched from the worker.

Intra-op threads on CPU: OpenMP teams are per thread (see
`worker.BackwardWorker`); the worker sets its own count itself
(`worker_threads`). With `EraseModel(intra_op_threads="auto")` the main thread
and the worker each use `threads_for_worker()` (half the cores), so the main
thread's forward and the worker's backward split the machine instead of
oversubscribing it (`keras_erase.torch.threads`).
"""

from keras_erase.config import Schedule
from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
from keras_erase.torch.schedules.blocking import BlockingDispatcher
from keras_erase.torch.schedules.streams import StreamDispatcher
from keras_erase.torch.schedules.threaded import ThreadedDispatcher

__all__ = ["make_dispatcher"]


def make_dispatcher(
    mode, num_streams=None, cuda_graphs=False, graph_capture=None, graph_warmup=None,
    worker_threads=None, streams=None,
):
    """Builds the dispatcher of a schedule: a preset or a `Schedule.label`.

    `mode`: `"blocking"`, `"threaded"`, `"streams"` or a label such as
    `"inline+block_streams"` or `"threaded+graphs"` (a `"+graphs"` label
    turns `cuda_graphs` on). With `cuda_graphs=True` the dispatcher gets a
    `CudaGraphRunner` as `dispatcher.graphs`, capturing with `graph_capture`
    (default: `keras_erase.torch.cuda_graphs.capture.default_capture()`, which
    raises `require_cuda`'s error without CUDA) after `graph_warmup` eager
    steps per block and input signature. `num_streams`: the block-stream cap
    (`None`: one per block). `worker_threads`: intra-op threads of the worker
    thread. `streams`: the stream API of the `"block_streams"` placement
    (`CudaStreams()` by default; a fake in CPU tests).

    Example:

    >>> make_dispatcher("threaded").name
    'worker+default_stream'
    """
    try:
        schedule = Schedule.from_label(mode)
    except (ValueError, AttributeError):
        raise ValueError(
            "make_dispatcher: `mode` must be 'blocking', 'threaded', 'streams' or a schedule "
            f"label '<inline|worker>+<default_stream|block_streams>[+graphs]'. Received: mode={mode!r}"
        ) from None
    if schedule.placement == "block_streams":
        dispatcher = StreamDispatcher(
            num_streams=num_streams, streams=streams, launcher=schedule.launcher,
            worker_threads=worker_threads,
        )
    elif schedule.launcher == "worker":
        dispatcher = ThreadedDispatcher(worker_threads=worker_threads)
    else:
        dispatcher = BlockingDispatcher()
    if cuda_graphs or schedule.graphs:
        warmup = DEFAULT_WARMUP if graph_warmup is None else graph_warmup
        dispatcher.graphs = CudaGraphRunner(capture=graph_capture, warmup=warmup,
                                            backward_on_worker=schedule.launcher == "worker")
    return dispatcher
