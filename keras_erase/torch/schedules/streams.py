"""`StreamDispatcher` (`dispatch="streams"`, CUDA): each block's forward and backward on its own stream.

Placement `"block_streams"` (`keras_erase.torch.schedules.placements.BlockStreams`)
with either launcher. Per block:

1. Tensors of the step that are not on the device yet (a CPU batch from a
   `torch.utils.data.DataLoader`) are moved there on the main stream.
2. The block's stream (one per block by default; `num_streams` caps them,
   round robin) waits for the main stream, so it reads finished inputs.
3. On the block's stream: the forward pass and local loss (replayed from CUDA
   Graphs when the dispatcher has a `graphs` runner, see
   `keras_erase.torch.cuda_graphs`), then an event recorded right after it.
4. The main stream waits on that event (the forward, not the backward) before
   later layers use the outputs.
5. The launcher launches the backward: the main thread (`"inline"`) or the
   worker thread (`"worker"`, the `"streams"` preset) enters the block's
   stream, which waits on the forward's event, and runs the local loss's
   backward there.
6. Tensors crossing streams get `record_stream` (CUDA tensors only): the
   inputs for the block's stream; the outputs, the loss, the block's
   parameter `.grad`s and its input gradients for the main stream. So the
   caching allocator never reuses their memory while another stream reads them.
7. A `detach_input=False` block's backward ends at its input: its input
   gradient is handed over (`keras_erase.torch.handoff`) and summed on the main
   stream for the one backward of the shared upstream, after the main loss's
   own backward (which needs no block stream). So a block's backward never
   reaches main-stream autograd nodes, which would make the main stream (and
   through it the next block's stream) wait for it.

The stream API is pluggable (`streams=`): `CudaStreams` on CUDA; the tests
pass a CPU fake that records the waits and events.

Example (CUDA):

```python
model = keras_erase.EraseModel(inputs, outputs, dispatch="streams")   # worker, a stream per block
```
"""

from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.schedules.launchers import make_launcher
from keras_erase.torch.schedules.placements import BlockStreams
from keras_erase.torch.schedules.placements import CudaStreams
from keras_erase.torch.schedules.placements import protect
from keras_erase.torch.tensors import to_device

__all__ = ["CudaStreams", "StreamDispatcher", "protect"]


def _move(structure, device):
    return to_device(structure, device)  # looked up here at each call (tests spy on it)


class StreamDispatcher(Dispatcher):
    """Each block's forward and backward on its own CUDA stream (see the module docstring).

    Args:
        num_streams: `None` (default): one stream per block; an int caps them
            (round robin over blocks).
        streams: the stream API (`CudaStreams()` by default).
        launcher: `"inline"` (default for this class) or `"worker"` (what the
            `"streams"` preset uses); `worker_threads` is the worker's intra-op
            thread count.
    """

    def __init__(self, num_streams=None, streams=None, launcher="inline", worker_threads=None):
        super().__init__(
            make_launcher(launcher, threads=worker_threads),
            BlockStreams(streams, num_streams=num_streams, move=_move),
        )

    @property
    def api(self):
        return self.placement.api

    @property
    def streams(self):
        return self.placement.streams
