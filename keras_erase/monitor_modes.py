"""Keras's monitoring callbacks minimise the blocks' local losses as they do `loss`.

In `mode="auto"` a callback knows the direction of `"loss"` and of compiled
metrics only; the block losses are neither.
"""

__all__ = ["minimise_block_losses"]


def minimise_block_losses(callbacks, loss_names):
    """Sets `mode="min"` on the `"auto"` callbacks that monitor one of `loss_names`; returns them."""
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
