"""`StreamDispatcher` (`dispatch="streams"`, CUDA): each block's forward and backward on its own stream.

Per block, in the main thread:

1. Tensors of the step that are not on the device yet (a CPU batch from a
   `torch.utils.data.DataLoader`) are moved there on the main stream.
2. The block's stream (`num_streams` streams, round robin over blocks) waits
   for the main stream, so it reads finished inputs.
3. On the block's stream: the forward pass and local loss (replayed from CUDA
   Graphs when the dispatcher has a `graphs` runner, see
   `keras_erase.torch.cuda_graphs`), an event recorded right after it, then the
   local loss's backward. Tensors crossing streams are protected with
   `record_stream` (CUDA tensors only) so the caching allocator does not
   reuse their memory while another stream still reads them.
4. The main stream waits on that event (the forward, not the backward) before
   later layers use the outputs; `finish()` makes the main stream wait for every
   block stream used in the step.
5. A `detach_input=False` block's backward ends at its input: its input
   gradient (made on the block's stream, protected for the main stream) is
   handed over (`keras_erase.torch.handoff`) and summed on the main stream after
   `finish()`, for the one backward of the shared upstream. So a block's
   backward never reaches main-stream autograd nodes, which would make the
   main stream (and through it the next block's stream) wait for it.

The stream API is pluggable (`streams=`): `CudaStreams` on CUDA; the tests
pass a CPU fake that records the waits and events.

Example (CUDA):

```python
model = keras_erase.EraseModel(inputs, outputs, dispatch="streams", num_streams=4)
```
"""

import time

import torch

from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.tensors import detach_tensors
from keras_erase.torch.tensors import flat_tensors
from keras_erase.torch.tensors import require_cuda
from keras_erase.torch.tensors import to_device

__all__ = ["CudaStreams", "StreamDispatcher"]


class CudaStreams:
    """The `torch.cuda` stream calls `StreamDispatcher` makes (replaced by a fake in CPU tests)."""

    def __init__(self):
        require_cuda("dispatch='streams'")
        self.device = torch.device("cuda", torch.cuda.current_device())

    def new_stream(self):
        return torch.cuda.Stream()

    def current_stream(self):
        return torch.cuda.current_stream()

    def use(self, stream):
        return torch.cuda.stream(stream)

    def new_event(self):
        return torch.cuda.Event()


def protect(tensors, stream):
    """Calls `record_stream(stream)` on each CUDA tensor (CPU tensors have no stream; skipped)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


class StreamDispatcher(Dispatcher):
    """Each block's forward and backward on its own CUDA stream (see the module docstring).

    Args:
        num_streams: streams used round robin over blocks (>= 1).
        streams: the stream API (`CudaStreams()` by default).
    """

    name = "streams"
    sums_on_block_thread = False  # one stream per block: sum on the main stream at the end

    def __init__(self, num_streams=4, streams=None):
        super().__init__()
        if int(num_streams) < 1:
            raise ValueError(f"`num_streams` must be >= 1. Received: num_streams={num_streams}")
        self.api = streams if streams is not None else CudaStreams()
        self.streams = [self.api.new_stream() for _ in range(int(num_streams))]
        self._next = 0
        self._block_stream = {}
        self._used = []
        self._main = None

    def _stream_for(self, block):
        key = id(block)
        if key not in self._block_stream:
            self._block_stream[key] = self.streams[self._next % len(self.streams)]
            self._next += 1
        return self._block_stream[key]

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        api = self.api
        inputs, y_true, sample_weight = to_device((inputs, y_true, sample_weight), api.device)
        main = self._main = api.current_stream()
        stream = self._stream_for(block)
        stream.wait_stream(main)
        if stream not in self._used:
            self._used.append(stream)
        with api.use(stream):
            protect(flat_tensors((inputs, y_true, sample_weight)), stream)
            outputs, loss, cuts = self._timed_forward(block, inputs, y_true, sample_weight)
            ready = api.new_event()
            ready.record(stream)
            if loss.requires_grad:
                self._record(block, "submit", time.perf_counter())
                self._timed_backward(block, scale_loss(loss), cuts)
        main.wait_event(ready)
        outputs, loss = detach_tensors(outputs), loss.detach()
        protect(flat_tensors(outputs) + [loss], main)
        return outputs, loss

    def _hand_over(self, cuts):
        # The input gradients, made on the block's stream, are summed and used on the main one.
        protect([leaf.grad for _, leaf in cuts], self._main)
        super()._hand_over(cuts)

    def close(self):
        """Drops the block graphs (a later step recaptures them)."""
        super().close()
        self._used = []

    def _wait(self):
        main = self.api.current_stream()
        for stream in self._used:
            main.wait_stream(stream)
        self._used = []
