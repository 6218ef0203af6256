"""A CPU stand-in for CUDA streams that checks what CUDA would get wrong (a stream sanitizer).

`CheckedStreams` is the stream API of the `"block_streams"` placement
(`keras_erase.torch.schedules.placements`) on a CPU machine. It models CUDA's
stream semantics with vector clocks and watches every aten op (a
`TorchDispatchMode`, entered on every thread that enters a stream) as if it
ran on the calling thread's current stream:

- current streams are per thread (`use(stream)` sets the calling thread's);
- each op is one step of its stream's clock; `wait_stream`, `Event.record`
  and `wait_event` order streams as on CUDA (host timing plays no part: what
  matters is the order in which the host enqueued work, as on a GPU);
- an op that reads or writes a tensor last written by another stream must be
  ordered after that write (otherwise a `race`);
- `record_stream` calls are remembered per memory (`protected`), so a test
  can check that a tensor crossing streams was protected (the caching
  allocator then cannot reuse its memory too early).

A fresh op output resets what is known about its memory (the CPU allocator
reuses addresses; on CUDA the caching allocator keeps a stream's freed memory
for that stream). `problems()` lists the races found; `ops_on` counts ops per
stream and `entered` says which thread entered which stream (tests use them
to check that work really ran on the block streams, launched from the
worker). A thread's ops are watched on the thread that calls `watching()`
and inside stream scopes on other threads.

Example:

```python
streams = CheckedStreams()
with streams.watching():
    model.fit(x, y)
assert streams.problems() == []
```
"""

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keras_erase.torch.cuda_graphs.op_recording import _written_args
from keras_erase.torch.tensors import flat_tensors

__all__ = ["CheckedStreams"]


class FakeStream:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name
        self.clock = {name: 0}

    def tick(self):
        self.clock[self.name] += 1
        return self.clock[self.name]

    def _merge(self, other_clock):
        for key, value in other_clock.items():
            self.clock[key] = max(self.clock.get(key, 0), value)

    def wait_stream(self, other):
        with self.owner.lock:
            self.owner.log.append(("wait_stream", self.name, other.name))
            self._merge(dict(other.clock))

    def wait_event(self, event):
        with self.owner.lock:
            self.owner.log.append(("wait_event", self.name, event.name))
            self._merge(event.clock)

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, owner, name):
        self.owner, self.name, self.clock = owner, name, {}

    def record(self, stream):
        with self.owner.lock:
            self.owner.log.append(("record", self.name, stream.name))
            self.clock = dict(stream.clock)


def _ptr(t):
    return t.untyped_storage().data_ptr()


class _Watch(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._on_op(func, args, kwargs, out)
        return out


class CheckedStreams:
    """The stream API of `BlockStreams` on CPU, checking CUDA's ordering rules (see the module)."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.log = []
        self.main = FakeStream(self, "main")
        self.streams = [self.main]
        self._local = threading.local()
        self._count = 0
        self._writes = {}  # storage ptr -> (stream name, clock value)
        self._protected = {}  # storage ptr -> set of stream names
        self.races = []
        self.ops_on = {}
        self.entered = []  # (thread name, stream name) of every `use`
        self.watched = False

    # -- the stream API -----------------------------------------------------------------

    def new_stream(self):
        with self.lock:
            self._count += 1
            stream = FakeStream(self, f"s{self._count}")
            self.streams.append(stream)
            return stream

    def current_stream(self):
        return getattr(self._local, "stream", self.main)

    def new_event(self):
        with self.lock:
            self._count += 1
            return FakeEvent(self, f"e{self._count}")

    @contextlib.contextmanager
    def use(self, stream):
        previous = self.current_stream()
        self._local.stream = stream
        self.log.append(("enter", stream.name))
        self.entered.append((threading.current_thread().name, stream.name))
        watch = None
        if self.watched and not getattr(self._local, "watching", False):
            watch = _Watch(self)  # this thread's ops are watched too (modes are per thread)
            self._local.watching = True
            watch.__enter__()
        try:
            yield
        finally:
            if watch is not None:
                watch.__exit__(None, None, None)
                self._local.watching = False
            self._local.stream = previous
            self.log.append(("exit", stream.name))

    def record_stream(self, tensor, stream):
        with self.lock:
            self.log.append(("record_stream", stream.name))
            self._protected.setdefault(_ptr(tensor), set()).add(stream.name)

    # -- checking -----------------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self):
        """Watches every op of the calling thread (and of threads entering a stream)."""
        self.watched = True
        self._local.watching = True
        watch = _Watch(self)
        with watch:
            try:
                yield self
            finally:
                self._local.watching = False
                self.watched = False

    def _on_op(self, func, args, kwargs, out):
        stream = self.current_stream()
        inputs = flat_tensors(args) + flat_tensors(kwargs)  # read (or written in place)
        outputs = flat_tensors(out)
        returns = func._schema.returns
        lifted = func.__name__.startswith("lift_fresh")
        if not lifted and returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in returns
        ):
            return  # a view: metadata only, no kernel reads or writes device memory
        if lifted:
            inputs = []
        with self.lock:
            now = stream.tick()
            self.ops_on[stream.name] = self.ops_on.get(stream.name, 0) + 1
            for t in inputs:  # a fresh output's memory is the allocator's (per stream on CUDA)
                if t.numel() == 0:
                    continue
                key = _ptr(t)
                write = self._writes.get(key)
                if write is not None and write[0] != stream.name:
                    if stream.clock.get(write[0], 0) < write[1]:
                        self.races.append((func.__name__, stream.name, write[:2]))
            lifted = func.__name__.startswith("lift_fresh")  # host data: made outside the schedule_run
            for index, t in enumerate(outputs):
                key = _ptr(t)
                fresh = lifted or (index < len(returns) and returns[index].alias_info is None)
                if fresh:  # a new allocation on this stream
                    self._protected.pop(key, None)
                self._writes[key] = (stream.name, now, func.__name__)
            for t in _written_args(func, args, kwargs):
                self._writes[_ptr(t)] = (stream.name, now, func.__name__)

    def problems(self):
        """Every race seen (deduplicated): `(op, stream, (writer stream, its clock))`."""
        return sorted(set(self.races))

    def protected(self, tensor, stream_name):
        """Whether `tensor`'s memory had `record_stream` for the stream named `stream_name`."""
        with self.lock:
            return stream_name in self._protected.get(_ptr(tensor), ())
