"""`EraseRuntime`: everything an `EraseModel` changes while it trains, in one plain object.

Kept outside Keras's and torch's attribute tracking (the model stores it once,
as `model._erase`), so none of it is saved, tracked as a layer or a weight.

`torch_runtime()` is the one door from the backend-neutral code into
`keras_erase.torch` (every module that imports torch): it is called on the
torch backend only, so `import keras_erase` needs no torch elsewhere.
"""

from keras_erase.local_losses import LocalLossTrackers

__all__ = ["EraseRuntime", "torch_runtime"]


def torch_runtime():
    """Imports and returns `keras_erase.torch` with its two entry modules loaded.

    The entry modules are `train_step` (the ERASE train step, used by
    `EraseModel`) and `tensors` (its `reached`, used by `keras_erase.frozen_upstream`).
    This is the only import of `keras_erase.torch` outside that package; call
    it on the torch backend only.

    Example:

    ```python
    if keras.backend.backend() == "torch":
        logs = torch_runtime().train_step.train_step(model, model._erase, data, step)
    ```
    """
    import keras_erase.torch.tensors
    import keras_erase.torch.train_step

    return keras_erase.torch


class EraseRuntime:
    """Runtime state of one `EraseModel`.

    Attributes:
        config: the model's `EraseConfig`.
        dispatch_choice: the schedule in use (`None` while `"auto"` measures;
            on torch read through `keras_erase.torch.train_step.dispatch_choice`,
            which answers `"standard"` for `"auto"` on a CPU): the preset's
            name, or a `keras_erase.config.Schedule` label (e.g.
            `"streams+graphs"`, `"inline+block_streams"`).
        selector: the `ScheduleSelector` of `"auto"` on CUDA (created at the first step).
        trackers: the local-loss `LocalLossTrackers`.
        dispatchers: `{Schedule: Dispatcher}` built so far (torch).
        trace: the event list while tracing, else `None`.
        grad_sync: the `GradientSync` under a torch.distributed group.
        needs_broadcast: broadcast rank 0's weights at the next step.
        in_test_step: set during `test_step`: blocks then keep their head's
            prediction in inference mode (validation logs the local losses).
        in_train_step: set during `train_step`: the model's `DetachBlock`s
            called with `training=None` then train (a `call` without `training`).
        blocks_own_losses: while set (torch ERASE step), `model.losses` leaves
            out the blocks' own losses (back-propagated by their early backward).
    """

    def __init__(self, config, is_torch):
        self.config = config
        self.dispatch_choice = (
            "standard" if not is_torch else (None if config.dispatch == "auto" else config.dispatch)
        )
        self.selector = None
        self.trackers = LocalLossTrackers()
        self.dispatchers = {}
        self.trace = None
        self.grad_sync = None
        self.needs_broadcast = True
        self.in_test_step = False
        self.blocks_own_losses = False
        self.in_train_step = False
