"""The ERASE dispatchers (torch): `make_dispatcher` builds the one a `Schedule` describes.

A `keras_erase.config.Schedule` is three independent choices, and a
`base.Dispatcher` is composed of the matching parts:

- launcher (`launchers.py`): `"inline"` (the main thread, right after the
  block's forward) or `"worker"` (one FIFO worker thread, `worker.py`);
- placement (`placements.py`): `"default_stream"` or `"block_streams"` (CUDA:
  the block's forward and backward on a stream of its own);
- graphs: off, or each block captured and replayed
  (`keras_erase.torch.cuda_graphs.runner.CudaGraphRunner` as `graphs`).

`base.py` states what every dispatcher does for a step (`run_block`,
`final_backward`, `finish`, `abort`, `close`). A worker error is re-raised by
`finish()` on the main thread; the worker keeps serving, so the next step
works and nothing hangs. Keras state (thread-local scopes) is never touched
from the worker.
"""

from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.schedules.launchers import make_launcher
from keras_erase.torch.schedules.placements import make_placement

__all__ = ["make_dispatcher"]


def make_dispatcher(
    schedule, num_streams=None, worker_threads=None, streams=None, graph_capture=None,
    graph_warmup=None,
):
    """Builds the dispatcher of `schedule` (a `keras_erase.config.Schedule`).

    `num_streams`: the block-stream cap (`None`: one per block).
    `worker_threads`: intra-op threads of the worker thread. `streams`: the
    stream API of the `"block_streams"` placement (`CudaStreams()` by default;
    a fake in CPU tests). A graphed schedule's dispatcher gets a
    `CudaGraphRunner` as `dispatcher.graphs`, capturing with `graph_capture`
    (default: `keras_erase.torch.cuda_graphs.capture.default_capture()`) after
    `graph_warmup` eager steps per block and input signature.

    Example:

    >>> from keras_erase.config import Schedule
    >>> make_dispatcher(Schedule("worker", "default_stream")).name
    'worker+default_stream'
    """
    block_streams = schedule.placement == "block_streams"
    dispatcher = Dispatcher(
        make_launcher(schedule.launcher, threads=worker_threads),
        make_placement(schedule.placement, num_streams=num_streams,
                       api=streams if block_streams else None),
    )
    if schedule.graphs:
        warmup = DEFAULT_WARMUP if graph_warmup is None else graph_warmup
        dispatcher.graphs = CudaGraphRunner(capture=graph_capture, warmup=warmup,
                                            backward_on_worker=schedule.launcher == "worker")
    return dispatcher
