"""Where a block's forward and backward run: `DefaultStream` or `BlockStreams` (a CUDA stream per block).

Per block, in order: `enter` (inputs on the device, the block's stream waits
for the main one), `forward_scope`, `forward_done` (the forward's event),
`to_main` (the main stream waits for the forward only), `backward_scope` (on
the launching thread, whose current stream it sets: streams are per thread),
`protect_gradients` (`record_stream(main)` on the `.grad`s and handed-over
gradients, so the allocator never reuses them while the main stream reads);
`before_main_backward()` (the main stream waits for the block backwards that
write a `.grad` the main loss's backward writes too); `join()` after the
launcher drained. A weight whose `.grad` several streams write (`share`: a
block's weight also on the main path or in another block) is accumulated in
event order: a backward's stream waits for the last other stream that wrote it. `DefaultStream` has a worker launch onto
the forward's stream too. The stream API is pluggable (`api=`;
`set_default_streams` for the CPU tests' fake).
"""

import contextlib

import torch

from keras_erase._keras_private import uncast_value
from keras_erase.torch.tensors import flat_tensors
from keras_erase.torch.tensors import require_cuda
from keras_erase.torch.tensors import to_device

__all__ = [
    "BlockStreams", "CudaStreams", "DefaultStream", "make_placement", "protect", "require_streams",
    "set_default_streams",
]

_STREAMS_FACTORY = None


def set_default_streams(factory):
    """Sets the stream API of `"block_streams"` (`None`: `CudaStreams`); returns the old one."""
    global _STREAMS_FACTORY
    previous, _STREAMS_FACTORY = _STREAMS_FACTORY, factory
    return previous


def require_streams(what):
    """Raises `require_cuda`'s error unless CUDA or a stand-in (`set_default_streams`) gives streams."""
    if _STREAMS_FACTORY is None:
        require_cuda(what)


def _default_streams():
    return _STREAMS_FACTORY() if _STREAMS_FACTORY is not None else CudaStreams()


class CudaStreams:
    def __init__(self):
        require_cuda("placement='block_streams'")
        self.device = torch.device("cuda", torch.cuda.current_device())

    def new_stream(self):
        return torch.cuda.Stream()

    def current_stream(self):
        return torch.cuda.current_stream()

    def use(self, stream):
        return torch.cuda.stream(stream)

    def new_event(self):
        return torch.cuda.Event()

    def record_stream(self, tensor, stream):
        if tensor.is_cuda:
            tensor.record_stream(stream)


def protect(tensors, stream, api=None):
    record = getattr(api, "record_stream", None)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if record is not None:
            record(t, stream)
        elif t.is_cuda:
            t.record_stream(stream)


def _gradients(block, cuts):
    grads = [leaf.grad for _, leaf in cuts]
    grads += [uncast_value(v).grad for v in block.trainable_weights]
    return [g for g in grads if g is not None]


class DefaultStream:
    """Every block on the stream current at its forward; `api`: `None` makes every scope a no-op."""

    name = "default_stream"
    one_stream = True  # every block backward runs in order on one stream
    orders_main = False

    def __init__(self, api=None):
        self.api = api
        self._forward_stream = {}

    def enter(self, block, tensors):
        if self.api is not None:
            self._forward_stream[id(block)] = self.api.current_stream()
        return tensors

    def forward_scope(self, block):
        return contextlib.nullcontext()

    def forward_done(self, block):
        return None

    def to_main(self, tensors, ready):
        pass

    @contextlib.contextmanager
    def backward_scope(self, block, ready):
        stream = self._forward_stream.get(id(block)) if self.api is not None else None
        if stream is None:
            yield
            return
        with self.api.use(stream):  # a worker thread launches onto the forward's stream
            yield

    def protect_gradients(self, block, cuts):
        pass

    def share(self, shared, on_main):
        pass

    def before_main_backward(self):
        pass

    def join(self):
        pass

    def close(self):
        self._forward_stream = {}


class BlockStreams:
    """Each block on its own CUDA stream; `num_streams` caps them (shared round robin)."""

    name = "block_streams"
    one_stream = False  # one stream per block: the hand-off sums on the main stream

    def __init__(self, api=None, num_streams=None):
        if num_streams is not None and int(num_streams) < 1:
            raise ValueError(
                f"`num_streams` must be None or >= 1. Received: num_streams={num_streams}"
            )
        self.api = api if api is not None else _default_streams()
        self.num_streams = None if num_streams is None else int(num_streams)
        self.streams = []
        self._block_stream = {}
        self._used = []
        self.main = None
        self._shared = {}  # id(block) -> ids of its weights whose `.grad` another stream writes
        self._on_main = set()  # ids of those the main loss's backward writes too
        self._last_write = {}  # weight id -> (stream, event after its last backward), this step

    def share(self, shared, on_main):
        """`shared`: `{id(block): weight ids}` not owned by the block; `on_main`: those the main path uses."""
        self._shared = {key: frozenset(ids) for key, ids in shared.items() if ids}
        self._on_main = set(on_main)

    def stream_for(self, block):
        key = id(block)
        stream = self._block_stream.get(key)
        if stream is None:
            if self.num_streams is None or len(self.streams) < self.num_streams:
                self.streams.append(self.api.new_stream())
                stream = self.streams[-1]
            else:
                stream = self.streams[len(self._block_stream) % self.num_streams]
            self._block_stream[key] = stream
        return stream

    def enter(self, block, tensors):
        api = self.api
        tensors = to_device(tensors, api.device)  # a CPU batch moves to the device
        main = self.main = api.current_stream()
        stream = self.stream_for(block)
        stream.wait_stream(main)  # the block reads finished inputs
        if all(stream is not s for s in self._used):
            self._used.append(stream)
        protect(flat_tensors(tensors), stream, api)
        return tensors

    def forward_scope(self, block):
        return self.api.use(self.stream_for(block))

    def forward_done(self, block):
        ready = self.api.new_event()
        ready.record(self.stream_for(block))
        return ready

    def to_main(self, tensors, ready):
        self.main.wait_event(ready)  # the forward, not the backward
        protect(tensors, self.main, self.api)

    @contextlib.contextmanager
    def backward_scope(self, block, ready):
        stream = self.stream_for(block)
        shared = self._shared.get(id(block), ())
        with self.api.use(stream):
            stream.wait_event(ready)  # ordered after the forward whatever thread launches
            writes = (self._last_write.get(key) for key in shared)
            for other, event in {id(w[1]): w for w in writes if w is not None}.values():
                if other is not stream:  # another stream accumulated into a shared `.grad`
                    stream.wait_event(event)
            yield
            if shared:
                done = self.api.new_event()
                done.record(stream)
                self._last_write.update((key, (stream, done)) for key in shared)

    def protect_gradients(self, block, cuts):
        protect(_gradients(block, cuts), self.main, self.api)

    def before_main_backward(self):
        """The main stream waits for the backwards of the blocks that share a weight with the main path.

        Called after the launcher launched every block backward.
        """
        main = self.api.current_stream()
        events = {id(e): e for key, (_, e) in self._last_write.items() if key in self._on_main}
        for event in events.values():
            main.wait_event(event)

    @property
    def orders_main(self):
        """Whether the main loss's backward writes a `.grad` that a block's stream writes too."""
        return bool(self._on_main)

    def join(self):
        main = self.api.current_stream()
        for stream in self._used:
            main.wait_stream(stream)
        self._used = []
        self._last_write = {}

    def close(self):
        self._used = []
        self._last_write = {}


def make_placement(name, num_streams=None, api=None):
    if name == "default_stream":
        if api is None and torch.cuda.is_available():
            api = CudaStreams()
        return DefaultStream(api)
    if name == "block_streams":
        return BlockStreams(api, num_streams=num_streams)
    raise ValueError(
        "`placement` must be 'default_stream' or 'block_streams'. "
        f"Received: placement={name!r}"
    )
