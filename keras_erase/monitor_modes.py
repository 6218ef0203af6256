"""Keras's monitoring callbacks minimise the blocks' local losses as they do `loss`.

`EarlyStopping`, `ModelCheckpoint` (and any `MonitorCallback`) in
`mode="auto"` decide the direction from the monitored name: `"loss"` and
`"val_loss"` are minimised; any other name must be a compiled metric with a
known direction, else the callback raises at its first use. The blocks' local
losses (`"<block>_loss"`, `"val_<block>_loss"`) are `keras.metrics.Mean`
trackers outside the compiled metrics, so `EraseModel.fit` sets
`mode="min"` on every callback in `mode="auto"` that monitors one of them
(their public `mode` attribute), as Keras does for `loss`.

Example:

>>> import keras
>>> stop = keras.callbacks.EarlyStopping(monitor="val_tower_0_loss")
>>> minimise_block_losses([stop], ["tower_0_loss"])
[<...EarlyStopping object at ...>]
>>> stop.mode
'min'
"""

__all__ = ["minimise_block_losses"]


def minimise_block_losses(callbacks, loss_names):
    """Sets `mode="min"` on callbacks in `"auto"` mode that monitor a block loss; returns them.

    Args:
        callbacks: the callbacks given to `fit` (a list, a `CallbackList` or `None`).
        loss_names: the logged block-loss names (`"<block name>_loss"`).
    """
    names = set(loss_names)
    names |= {f"val_{name}" for name in names}
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        callbacks = getattr(callbacks, "callbacks", [callbacks])  # a CallbackList
    changed = []
    for callback in list(callbacks or []):
        monitor = getattr(callback, "monitor", None)
        if monitor in names and getattr(callback, "mode", None) == "auto":
            callback.mode = "min"
            changed.append(callback)
    return changed
