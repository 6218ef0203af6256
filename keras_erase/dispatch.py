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
  the next step works and nothing hangs.
- `StreamDispatcher` (`"streams"`, CUDA): each block's forward and backward run
  on its own CUDA stream (`num_streams` streams, round robin). The block's stream
  waits for the main stream before reading the inputs, cross-stream tensors are
  protected with `record_stream`, the main stream waits on an event recorded
  right after the block's forward (not after its backward) before using the
  outputs, and `finish()` makes the main stream wait for every block stream.
  With `cuda_graphs=True` each block (forward + local loss, and its backward)
  is captured once per input shape with `torch.cuda.make_graphed_callables`
  after `graph_warmup` eager calls; a batch of an unseen shape runs eagerly
  first, and a block that fails to capture falls back to eager with a warning.

Intra-op threads on CPU: `torch.set_num_threads` is process-wide, the worker
thread cannot keep a smaller pool than the main thread. `threads_for_worker()`
returns the policy used by `"threaded"` when `EraseModel(intra_op_threads=
"auto")`: half of the cores (at least 1), so the main thread's forward and the
worker's backward each use about half of the machine instead of both
oversubscribing it.
"""

import queue
import threading
import time
import warnings

import torch

from keras_erase.config import DISPATCH_MODES  # noqa: F401 - re-exported
from keras_erase.threads import set_intra_op_threads  # noqa: F401 - re-exported
from keras_erase.threads import threads_for_worker  # noqa: F401 - re-exported


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
    loss = block.local_loss(y_true, block.predict_local(outputs), sample_weight)
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
            outputs, loss = _forward(block, inputs, y_true, sample_weight)
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


class _Worker:
    """One FIFO worker thread running submitted closures; errors are kept for `wait()`."""

    def __init__(self, name="keras_erase-backward"):
        self._name = name
        self._queue = queue.Queue()
        self._errors = []
        self._thread = None
        self._lock = threading.Lock()

    def _ensure_alive(self):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if not self._errors:  # after an error, the rest of the step is skipped
                    job()
            except BaseException as error:  # noqa: BLE001 - re-raised by wait()
                self._errors.append(error)
            finally:
                self._queue.task_done()

    def submit(self, job):
        self._ensure_alive()
        self._queue.put(job)

    def wait(self):
        """Blocks until every submitted job ran; re-raises the first error."""
        if self._thread is not None and not self._thread.is_alive() and self._queue.unfinished_tasks:
            self._ensure_alive()  # never wait on a dead worker
        self._queue.join()
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def stop(self):
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._thread = None


class ThreadedDispatcher(Dispatcher):
    """Backward of each block submitted to one FIFO worker thread (pure torch autograd)."""

    name = "threaded"

    def __init__(self):
        super().__init__()
        self._worker = _Worker()

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


class StreamDispatcher(Dispatcher):
    """Each block's forward and backward on its own CUDA stream, optionally as CUDA Graphs."""

    name = "streams"

    def __init__(self, num_streams=4, cuda_graphs=False, graph_warmup=2):
        super().__init__()
        require_cuda("streams" if not cuda_graphs else "cuda_graphs=True")
        if int(num_streams) < 1:
            raise ValueError(f"`num_streams` must be >= 1. Received: num_streams={num_streams}")
        self.streams = [torch.cuda.Stream() for _ in range(int(num_streams))]
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_warmup = int(graph_warmup)
        self._next = 0
        self._block_stream = {}
        self._used = []
        self._seen = {}
        self._graphed = {}

    def _stream_for(self, block):
        key = id(block)
        if key not in self._block_stream:
            self._block_stream[key] = self.streams[self._next % len(self.streams)]
            self._next += 1
        return self._block_stream[key]

    def _graph_key(self, block, inputs, y_true, sample_weight):
        tensors = _tensors(inputs) + _tensors(y_true) + _tensors(sample_weight)
        return (id(block),) + tuple((tuple(t.shape), t.dtype) for t in tensors)

    def _graphed_forward(self, block, inputs, y_true, sample_weight):
        """Forward + local loss through a CUDA Graph once the shape has been seen enough."""
        key = self._graph_key(block, inputs, y_true, sample_weight)
        graphed = self._graphed.get(key)
        if graphed is None:
            count = self._seen.get(key, 0) + 1
            self._seen[key] = count
            if count <= self.graph_warmup:
                return _forward(block, inputs, y_true, sample_weight)
            graphed = self._capture(block, inputs, y_true, sample_weight)
            self._graphed[key] = graphed
        if graphed is False:
            return _forward(block, inputs, y_true, sample_weight)
        flat = _tensors(inputs) + _tensors(y_true) + _tensors(sample_weight)
        outputs, loss = graphed(*flat)
        return outputs, loss

    def _capture(self, block, inputs, y_true, sample_weight):
        n_in, n_y = len(_tensors(inputs)), len(_tensors(y_true))
        single = isinstance(inputs, torch.Tensor)

        class _Graphable(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *flat):
                x = flat[0] if single else list(flat[:n_in])
                y = flat[n_in] if n_y == 1 else list(flat[n_in : n_in + n_y])
                sw = flat[n_in + n_y] if len(flat) > n_in + n_y else None
                outputs, loss = _forward(self.inner, x, y, sw)
                return outputs.detach(), loss

        sample = tuple(
            t.detach().clone() for t in _tensors(inputs) + _tensors(y_true) + _tensors(sample_weight)
        )
        try:
            torch.cuda.synchronize()
            return torch.cuda.make_graphed_callables(_Graphable(block), sample)
        except Exception as error:  # capture is best effort: eager is always correct
            warnings.warn(
                f"keras_erase: CUDA Graph capture of block {block.name!r} failed "
                f"({type(error).__name__}: {error}); running it eagerly.",
                stacklevel=2,
            )
            return False

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        main = torch.cuda.current_stream()
        stream = self._stream_for(block)
        stream.wait_stream(main)
        if stream not in self._used:
            self._used.append(stream)
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for t in _tensors(inputs) + _tensors(y_true) + _tensors(sample_weight):
                t.record_stream(stream)
            with torch.profiler.record_function(f"{block.name}/forward"):
                if self.cuda_graphs:
                    outputs, loss = self._graphed_forward(block, inputs, y_true, sample_weight)
                else:
                    outputs, loss = _forward(block, inputs, y_true, sample_weight)
            ready = torch.cuda.Event()
            ready.record(stream)
            self._record(block, "forward", start, time.perf_counter())
            if loss.requires_grad:
                self._record(block, "submit", time.perf_counter())
                self._timed_backward(block, scale_loss(loss))
        main.wait_event(ready)
        outputs, loss = _detach(outputs), loss.detach()
        for t in _tensors(outputs) + [loss]:
            t.record_stream(main)
        return outputs, loss

    def finish(self):
        main = torch.cuda.current_stream()
        for stream in self._used:
            main.wait_stream(stream)
        self._used = []


def require_cuda(what):
    """Raises a clear `ValueError` when `what` needs CUDA and torch has none."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"keras_erase: {what} needs a CUDA device, but torch.cuda.is_available() is False. "
            "Use dispatch='threaded', 'blocking', 'standard' or 'auto' on CPU."
        )


def make_dispatcher(mode, num_streams=4, cuda_graphs=False):
    """Builds the dispatcher for a concrete mode (`"blocking"`, `"threaded"` or `"streams"`)."""
    if mode == "blocking":
        return BlockingDispatcher()
    if mode == "threaded":
        return ThreadedDispatcher()
    if mode == "streams":
        return StreamDispatcher(num_streams=num_streams, cuda_graphs=cuda_graphs)
    raise ValueError(
        f"Unknown dispatch mode {mode!r}; expected 'blocking', 'threaded' or 'streams'."
    )
