"""`EraseRuntime` (an `EraseModel`'s run-time state) and `torch_runtime()`, the one door into `keras_erase.torch`."""

from keras_erase.local_losses import LocalLossTrackers

__all__ = ["EraseRuntime", "torch_runtime"]


def torch_runtime():
    """Imports `keras_erase.torch` with its entry modules `train_step` and `tensors`; torch backend only.

    The only import of `keras_erase.torch` outside it, so `import keras_erase`
    needs no torch elsewhere.
    """
    import keras_erase.torch.tensors
    import keras_erase.torch.train_step

    return keras_erase.torch


class EraseRuntime:
    """Everything an `EraseModel` changes while it trains, in one plain object.

    Stored once as `model._erase`, outside Keras's and torch's attribute
    tracking: none of it is saved or tracked.

    Attributes:
        config: the model's `EraseConfig`.
        dispatch_choice: the label of the schedule in use (`None` while `"auto"`
            measures).
        selector: the `ScheduleSelector` of `"auto"` on CUDA.
        trackers: the `LocalLossTrackers`.
        dispatchers: `{Schedule: Dispatcher}` built so far (torch).
        trace: the event list while tracing, else `None`.
        grad_sync, needs_broadcast: the `GradientSync` under a process group,
            and whether rank 0's weights go out at the next step.
        in_test_step, in_train_step: set during `test_step` / `train_step`.
        blocks_own_losses: while set (torch ERASE step), `model.losses` leaves
            out the blocks' own losses.
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
