"""`EraseRuntime` (an `EraseModel`'s run-time state) and `torch_runtime()`, the door into torch/."""

from keras_erase.local_losses import LocalLossTrackers

__all__ = ["EraseRuntime", "torch_runtime"]


def torch_runtime():
    """Imports `keras_erase.torch` (entry modules `train_step`, `tensors`): its only import outside it."""
    import keras_erase.torch.tensors
    import keras_erase.torch.train_step

    return keras_erase.torch


class EraseRuntime:
    """What an `EraseModel` changes while it trains: `model._erase`, outside Keras's and torch's tracking.

    `dispatch_choice` is the name of the schedule in use (`None` while `"auto"`
    measures); `blocks_own_losses`, while set, leaves the blocks' own losses out
    of `model.losses` (the torch ERASE step back-propagates them early).
    """

    def __init__(self, config, is_torch):
        self.config = config
        self.dispatch_choice = (
            "standard" if not is_torch else (None if config.dispatch == "auto" else config.dispatch)
        )
        self.selector = None
        self.trackers = LocalLossTrackers()
        self.schedule_runs = {}
        self.trace = None
        self.grad_sync = None
        self.needs_broadcast = True
        self.in_test_step = False
        self.blocks_own_losses = False
        self.in_train_step = False
