"""`BlockingDispatcher` (`dispatch="blocking"`): each block's backward inline on the main thread.

The plainest early-backward schedule (launcher `"inline"`, placement
`"default_stream"`): right after a block's forward pass and local loss, the
main thread runs that loss's backward, then goes on with the forward pass of
the next layers. Nothing overlaps; the gradients are those of every other
schedule.

Example:

```python
model = keras_erase.EraseModel(inputs, outputs, dispatch="blocking")
```
"""

from keras_erase.torch.schedules.base import Dispatcher
from keras_erase.torch.schedules.launchers import InlineLauncher
from keras_erase.torch.schedules.placements import make_placement

__all__ = ["BlockingDispatcher"]


class BlockingDispatcher(Dispatcher):
    """Backward of each block inline on the main thread, right after its forward."""

    def __init__(self):
        super().__init__(InlineLauncher(), make_placement("default_stream"))
