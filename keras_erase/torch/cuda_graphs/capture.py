"""Capture back-ends for CUDA Graphs: `CudaGraphCapture` (CUDA) and `RecordingCapture` (CPU).

A capture is a callable `capture(fn, pool=None, stream=None) -> Capture`: it
runs `fn` once as a captured region on `stream` and returns a `Capture` whose
`replay()` reruns it on the same static tensors (on the replaying thread's
current stream) and whose `outputs` are the region's static outputs;
`release()` frees it. It also makes capture streams (`new_stream()`: the
runner gives each block its own) and runs a block's last eager warm-up step on
one (`warmup_scope(stream, tensors)`), so per-stream lazy state (the cuBLAS
workspace of that stream) is allocated there before the capture, outside any
graph's memory pool; each block's graphs then bake their own stream's
workspace, and blocks replayed concurrently on different streams never share one.

`CudaGraphCapture` captures a `torch.cuda.CUDAGraph`
(`capture_error_mode="thread_local"`, one capture at a time in the process);
`RecordingCapture` is the CPU stand-in the tests and the GPU benchmark's dry
run use (it records the region's aten ops with
`keras_erase.torch.cuda_graphs.op_recording.OpTape` and replays them, and
records which stream each capture and warm-up used). `set_default_capture`
picks what a runner built without a capture uses.

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
    """One captured region: `replay()` reruns it; `outputs` are its static output tensors.

    `release()` frees it (a CUDA graph and its hold on the memory pool); the
    capture is unusable afterwards.
    """

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
    """Captures a region as a `torch.cuda.CUDAGraph` (the default capture on CUDA).

    Captures are serialised by one lock per process (`_CAPTURE_LOCK`), shared
    by every `CudaGraphCapture` object: two threads never capture at once.
    The capture runs on a side stream (`stream`, the block's own capture
    stream, or this object's default one) that first waits for the current
    stream, with `capture_error_mode="thread_local"` (other threads may keep
    launching work), and the caller's current stream is restored in a
    `finally` whatever happens. Before `capture_begin` the stream's cuBLAS
    handle and workspace are made (outside the graph's pool). `pool`: the
    memory pool to capture into (`None`: a new private pool; the runner gives
    each block's forward/backward pair one).
    """

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.lock = _CAPTURE_LOCK  # one capture at a time in the process, whatever the object

    def new_stream(self):
        """A new capture stream (the runner makes one per block)."""
        return torch.cuda.Stream()

    @contextlib.contextmanager
    def warmup_scope(self, stream, tensors=()):
        """Runs the body (a block's last eager warm-up step) on `stream`; yields `to_caller(tensors)`.

        `stream` waits for the caller's stream first, `tensors` (the step's
        inputs) get `record_stream(stream)`; `to_caller` protects what the
        body made for the caller's stream, which waits for `stream` at exit.
        """
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
    """After a capture that raised: makes the caching allocator stop routing to `graph`'s pool.

    torch before 2.12 (pytorch#180395) raises out of `capture_end` (and
    `capture_begin`) before telling the allocator that the capture is over;
    it then asserts in `empty_cache()` and at later synchronisations. Where
    torch did end it, the allocator no longer knows the pool and the call is
    a no-op. (The pool's memory itself stays reserved until the process ends
    on torch without pytorch#190348.)
    """
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool())
    except Exception:  # noqa: BLE001 - nothing was left routed (or no CUDA): nothing to undo
        pass


def _make_stream_state():
    """Makes the current stream's cuBLAS handle and workspace now (outside any graph's pool)."""
    if torch.cuda.is_available():
        torch.cuda.current_blas_handle()


def _record(tensors, stream):
    for t in tensors:
        if is_tensor(t) and t.is_cuda:
            t.record_stream(stream)


def _detached_records(records):
    """The tape's records with every tensor detached (same memory, no autograd graph).

    No recursive closure here: a closure that calls itself is a reference
    cycle, which would keep the capture-time graph alive until the next
    garbage collection (and the next replays would accumulate through its
    AccumulateGrad nodes).
    """
    aliases = {}  # id -> (tensor, its one alias)

    def alias(t):
        if id(t) not in aliases:
            aliases[id(t)] = (t, t.detach())
        return aliases[id(t)][1]

    detached = [tuple(map_tensors(alias, part) for part in record) for record in records]
    aliases.clear()
    return detached


class CaptureStream:
    """A capture stream of `RecordingCapture` (a name; CPU has no streams)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"CaptureStream({self.name})"


class RecordingCapture:
    """CPU stand-in for `CudaGraphCapture`: records a region's aten ops and replays them.

    Like a CUDA graph, the replay reruns the same ops on the same (static)
    tensors: values read through Python at capture time stay frozen, new data
    must be copied into the static inputs. The capture refuses the ops a CUDA
    capture refuses (`CAPTURE_FORBIDDEN_OPS`) with `CaptureRefused`. It has to
    execute the region once while recording, but then restores every tensor
    that existed before and that the region wrote in place (batch-norm moving
    statistics, seed states) and torch's CPU random generator, so like a CUDA
    capture it leaves no side effect; a replay draws random numbers where the
    eager step would (unseeded `Dropout` replays as eager, as on CUDA).
    Its records hold detached tensors: nothing of the capture-time autograd
    graph (the AccumulateGrad nodes of the weights included) outlives the
    capture through it.

    Args:
        fail_after: make the capture number `fail_after` (1-based) raise
            `CaptureRefused` (to test failure handling), `None` for never.

    Attributes:
        captured: the recorded op names of every capture, in order.
        pools: the memory pool of every capture (a new one when none was given).
        streams: the stream of every capture (`None` when none was given).
        warmups: the stream of every `warmup_scope` (a block's last eager
            warm-up step).
        replays: how many replays ran.
        released: how many captures were released (`Capture.release`).
        live: how many captures are neither released nor garbage-collected.
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
        """A new capture stream (a named token)."""
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
        # statistics: `undo`) nor on the random generator, as torch's graph-safe CUDA generator
        # (a replay draws where eager would have, so unseeded Dropout replays match eager).
        with torch.random.fork_rng(devices=[]):
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
    """Sets what runners built without a capture use (`None`: `CudaGraphCapture`); returns the old one.

    `set_default_capture(RecordingCapture)` lets `EraseModel(cuda_graphs=True)`
    run its graph logic on a CPU machine (the tests and the GPU benchmark's
    `--cpu-dry-run` do this); real runs never need it.
    """
    global _CAPTURE_FACTORY
    previous, _CAPTURE_FACTORY = _CAPTURE_FACTORY, factory
    return previous


def require_capture():
    """Raises `require_cuda`'s clear error when graphs cannot be captured here.

    Graphs need CUDA, unless a CPU stand-in was set with `set_default_capture`.
    """
    if _CAPTURE_FACTORY is None:
        require_cuda("cuda_graphs=True")


def default_capture():
    """Returns the capture of a runner built without one: `CudaGraphCapture()` (needs CUDA)."""
    require_capture()
    if _CAPTURE_FACTORY is not None:
        return _CAPTURE_FACTORY()
    return CudaGraphCapture()
