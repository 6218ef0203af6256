"""`BlockingDispatcher` (`dispatch="blocking"`): each block's backward inline on the main thread.

The plainest early-backward schedule: right after a block's forward pass and
local loss, the main thread runs that loss's backward, then goes on with the
forward pass of the next layers. Nothing overlaps; the gradients are those of
every other schedule.

Example:

```python
model = keras_erase.EraseModel(inputs, outputs, dispatch="blocking")
```
"""

import time

from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.tensors import detach_tensors

__all__ = ["BlockingDispatcher"]


class BlockingDispatcher(Dispatcher):
    """Backward of each block inline on the main thread, right after its forward."""

    name = "blocking"

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        outputs, loss, cuts = self._timed_forward(block, inputs, y_true, sample_weight)
        self._record(block, "submit", time.perf_counter())
        if loss.requires_grad:
            self._timed_backward(block, scale_loss(loss), cuts)
        return detach_tensors(outputs), loss.detach()
