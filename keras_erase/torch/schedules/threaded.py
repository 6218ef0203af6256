"""`ThreadedDispatcher` (`dispatch="threaded"`): each block's backward on one FIFO worker thread.

Launcher `"worker"`, placement `"default_stream"`. The main thread runs the
forward passes; right after a block's forward pass and local loss its
backward is submitted to a `BackwardWorker`
(`keras_erase.torch.schedules.worker`), which runs nothing but
`torch.autograd.backward`, in submission order, while the main thread goes on
with the next layers. On CUDA the worker launches onto the stream the
block's forward ran on (host overlap; no device concurrency: use
`dispatch="streams"` for a stream per block).

Example:

```python
model = keras_erase.EraseModel(inputs, outputs, dispatch="threaded")
```
"""

from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.schedules.launchers import WorkerLauncher
from keras_erase.torch.schedules.placements import make_placement
from keras_erase.torch.schedules.worker import NAME
from keras_erase.torch.schedules.worker import BackwardWorker

__all__ = ["NAME", "BackwardWorker", "ThreadedDispatcher"]


class ThreadedDispatcher(Dispatcher):
    """Backward of each block submitted to one FIFO worker thread (pure torch autograd).

    Args:
        worker_threads: torch intra-op threads of the worker thread, set by the
            worker itself (`None`: left alone). See `BackwardWorker`.
    """

    def __init__(self, worker_threads=None):
        super().__init__(WorkerLauncher(threads=worker_threads), make_placement("default_stream"))

    @property
    def worker_threads(self):
        return self._worker.threads

    @worker_threads.setter
    def worker_threads(self, value):
        self._worker.threads = value
