"""CUDA Graph captures: `CudaGraphCapture` (CUDA) and `RecordingCapture` (its CPU stand-in).

A capture `capture(fn, pool=None, stream=None) -> Capture` runs `fn` once as
a captured region. `new_stream()` and `warmup_scope(stream, tensors)` let a
block's last warm-up step run on its capture stream, so that stream's cuBLAS
workspace exists before the capture, outside any graph's pool.

Example:

>>> import torch
>>> x = torch.ones(2)
>>> capture = RecordingCapture()(lambda: x * 2.0)
>>> _ = x.fill_(3.0); capture.replay(); capture.outputs.tolist()
[6.0, 6.0]
"""

import contextlib
import threading
import weakref

import torch

from keras_erase.torch.cuda_graphs.op_recording import CaptureRefused
from keras_erase.torch.cuda_graphs.op_recording import OpTape
from keras_erase.torch.tensors import is_tensor
from keras_erase.torch.tensors import map_tensors
from keras_erase.torch.tensors import require_cuda
from keras_erase.torch.tensors import same_storage

__all__ = [
    "Capture", "CaptureStream", "CudaGraphCapture", "RecordingCapture", "default_capture",
    "end_pool_routing", "require_capture", "set_default_capture",
]


class Capture:
    """One captured region: `replay()` reruns it, `outputs` are its static outputs, `release()` frees it."""

    def __init__(self, replay, outputs, pool=None, ops=(), release=None):
        self.replay = replay
        self.outputs = outputs
        self.pool = pool
        self.ops = tuple(ops)
        self._release = release
        self.released = False

    def release(self):
        if self.released:
            return
        self.released = True
        release, self._release = self._release, None
        self.replay = self.outputs = self.pool = None
        if release is not None:
            release()


# One capture at a time in the process: a capture region must not interleave with
# another thread's (the threaded worker may run replays, never captures, meanwhile).
_CAPTURE_LOCK = threading.Lock()


class CudaGraphCapture:
    """Captures a region as a `torch.cuda.CUDAGraph` (the default on CUDA).

    One capture at a time in the process (`_CAPTURE_LOCK`), on a side stream
    that waits for the caller's, with `capture_error_mode="thread_local"`.
    `pool`: the memory pool to capture into (`None`: a new private one).
    """

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.lock = _CAPTURE_LOCK  # one capture at a time in the process, whatever the object

    def new_stream(self):
        return torch.cuda.Stream()

    @contextlib.contextmanager
    def warmup_scope(self, stream, tensors=()):
        """Runs the body on `stream` after the caller's; yields `to_caller(made)` to protect its outputs."""
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        _record(tensors, stream)
        try:
            with torch.cuda.stream(stream):
                _make_stream_state()
                yield lambda made: _record(made, caller)
        finally:
            caller.wait_stream(stream)

    def __call__(self, fn, pool=None, stream=None):
        stream = self.stream if stream is None else stream
        graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.current_stream()
        with self.lock:
            stream.wait_stream(previous)
            torch.cuda.synchronize()
            try:
                torch.cuda.set_stream(stream)
                _make_stream_state()  # lazy per-stream state before capture_begin
                try:
                    if pool is None:
                        graph.capture_begin(capture_error_mode="thread_local")
                    else:
                        graph.capture_begin(pool, capture_error_mode="thread_local")
                except Exception:
                    end_pool_routing(graph)
                    raise
                failed = True
                try:
                    outputs = fn()
                    failed = False
                finally:
                    try:
                        graph.capture_end()
                    except Exception:
                        end_pool_routing(graph)
                        if not failed:  # otherwise keep the region's own error
                            raise
            finally:
                torch.cuda.set_stream(previous)
            previous.wait_stream(stream)
        return Capture(graph.replay, outputs, pool=graph.pool(), release=graph.reset)


def end_pool_routing(graph):
    """After a failed capture, stops the allocator routing to `graph`'s pool (docs/development.md)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool())
    except Exception:  # noqa: BLE001 - nothing was left routed (or no CUDA): nothing to undo
        pass


def _make_stream_state():
    """Makes the current stream's cuBLAS handle and workspace now, outside any graph's pool."""
    if torch.cuda.is_available():
        torch.cuda.current_blas_handle()


def _record(tensors, stream):
    for t in tensors:
        if is_tensor(t) and t.is_cuda:
            t.record_stream(stream)


def _detached_records(records):
    """The tape's records, tensors detached (no recursive closure: its cycle would keep the graph)."""
    aliases = {}  # id -> (tensor, its one alias)

    def alias(t):
        if id(t) not in aliases:
            aliases[id(t)] = (t, t.detach())
        return aliases[id(t)][1]

    detached = [tuple(map_tensors(alias, part) for part in record) for record in records]
    aliases.clear()
    return detached


class CaptureStream:
    """A named stream token of `RecordingCapture` (CPU has no streams)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"CaptureStream({self.name})"


class RecordingCapture:
    """CPU stand-in for `CudaGraphCapture`: records a region's aten ops, replays them on the same tensors.

    As a CUDA capture it refuses what CUDA refuses (`CaptureRefused`) and leaves
    no side effect. `fail_after`: capture number `fail_after` raises (tests).
    `captured`, `pools`, `streams`, `warmups`, `replays`, `released`, `live`:
    what it did.
    """

    def __init__(self, fail_after=None):
        self.fail_after = fail_after
        self.captured = []
        self.pools = []
        self.streams = []
        self.warmups = []
        self._made_streams = 0
        self.replays = 0
        self.released = 0
        self._live = weakref.WeakSet()

    @property
    def live(self):
        return sum(1 for c in list(self._live) if not c.released)

    def _count_release(self):
        self.released += 1

    def new_stream(self):
        self._made_streams += 1
        return CaptureStream(f"capture-{self._made_streams}")

    @contextlib.contextmanager
    def warmup_scope(self, stream, tensors=()):
        """Records that a warm-up step ran on `stream`; yields a no-op `to_caller`."""
        self.warmups.append(stream)
        yield lambda made: None

    def __call__(self, fn, pool=None, stream=None):
        if self.fail_after is not None and len(self.captured) + 1 >= self.fail_after:
            self.captured.append(("<injected failure>",))
            raise CaptureRefused("injected capture failure (RecordingCapture.fail_after)")
        tape = OpTape()
        # A CUDA capture runs nothing: leave no side effect, neither on tensors (batch-norm
        # statistics: `undo`) nor on the random generators (the CPU one and, on a GPU machine
        # where the recorded region runs on CUDA tensors, the current device's), as torch's
        # graph-safe CUDA generator: a replay draws where eager would have, so unseeded Dropout
        # replays match eager.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            with tape:
                outputs = fn()
        tape.undo()
        self.captured.append(tuple(tape.names))
        pool = pool if pool is not None else object()  # like a new private memory pool
        self.pools.append(pool)
        self.streams.append(stream)
        records = _detached_records(tape.records)
        tape.records.clear()

        def replay():
            self.replays += 1
            with torch.no_grad():
                for func, args, kwargs, out in records:
                    fresh = func(*args, **kwargs)
                    olds = out if isinstance(out, (tuple, list)) else (out,)
                    news = fresh if isinstance(fresh, (tuple, list)) else (fresh,)
                    for old, new in zip(olds, news):
                        if is_tensor(old) and is_tensor(new) and not same_storage(old, new):
                            old.copy_(new)

        records_box = [records]

        def release():  # like `CUDAGraph.reset()`: the recorded ops and their tensors go
            records_box.clear()
            records.clear()
            self._count_release()

        capture = Capture(replay, outputs, pool=pool, ops=tape.names, release=release)
        self._live.add(capture)
        return capture


_CAPTURE_FACTORY = None


def set_default_capture(factory):
    """Sets what runners built without a capture use (`None`: `CudaGraphCapture`); returns the old one."""
    global _CAPTURE_FACTORY
    previous, _CAPTURE_FACTORY = _CAPTURE_FACTORY, factory
    return previous


def require_capture():
    """Raises `require_cuda`'s error unless CUDA or a stand-in (`set_default_capture`) can capture."""
    if _CAPTURE_FACTORY is None:
        require_cuda("cuda_graphs=True")


def default_capture():
    require_capture()
    if _CAPTURE_FACTORY is not None:
        return _CAPTURE_FACTORY()
    return CudaGraphCapture()
