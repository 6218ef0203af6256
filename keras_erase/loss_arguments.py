"""`DetachBlock`'s `loss` and `loss_weight` arguments, checked and turned into what the block uses."""

import math
import numbers

import keras

__all__ = ["checked_loss_weight", "to_loss_object"]


class _FunctionLoss(keras.losses.Loss):
    """Wraps a plain loss function `fn(y_true, y_pred)` into a `keras.losses.Loss`."""

    def __init__(self, fn, name=None):
        super().__init__(name=name or getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def to_loss_object(loss):
    """Returns `loss` (a string, a function or a `keras.losses.Loss`) as a `keras.losses.Loss`.

    `None` stays `None` (a block without a local objective).
    """
    if loss is None or isinstance(loss, keras.losses.Loss):
        return loss
    obj = keras.losses.get(loss)
    if obj is None:
        raise ValueError(f"DetachBlock: unknown `loss`. Received: loss={loss!r}")
    if isinstance(obj, keras.losses.Loss):
        return obj
    if callable(obj):
        return _FunctionLoss(obj)
    raise TypeError(
        f"DetachBlock: `loss` must be a string, a callable or a `keras.losses.Loss`. "
        f"Received: loss={loss!r}"
    )


def checked_loss_weight(loss_weight):
    """Returns `loss_weight` as a float; raises naming it unless it is a finite number >= 0."""
    if isinstance(loss_weight, bool) or not isinstance(loss_weight, numbers.Real):
        raise TypeError(
            "DetachBlock: `loss_weight` must be a number >= 0. "
            f"Received: loss_weight={loss_weight!r} of type {type(loss_weight).__name__}"
        )
    value = float(loss_weight)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"DetachBlock: `loss_weight` must be a finite number >= 0. "
            f"Received: loss_weight={loss_weight!r}"
        )
    return value
