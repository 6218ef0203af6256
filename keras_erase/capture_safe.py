"""Local losses and weight penalties from device ops and Python constants: a CUDA Graph can capture them.

Keras's `Loss.__call__` and regularizers make tensors from host data at every
call. `DetachBlock` uses these on torch; JAX and TensorFlow keep Keras's calls.
"""

import keras
import numpy as np
from keras import ops
from keras import tree

from keras_erase import _keras_private

__all__ = ["capture_safe_loss", "is_capture_safe", "weight_penalty"]


def weight_penalty(regularizer, weight):
    """`regularizer(weight)`, with Python-float factors for Keras's L1, L2 and L1L2."""
    kind = type(regularizer)
    if kind is keras.regularizers.L1:
        return regularizer.l1 * ops.sum(ops.absolute(weight))
    if kind is keras.regularizers.L2:
        return regularizer.l2 * ops.sum(ops.square(weight))
    if kind is keras.regularizers.L1L2:
        total = None
        if regularizer.l1 != 0.0:
            total = regularizer.l1 * ops.sum(ops.absolute(weight))
        if regularizer.l2 != 0.0:
            term = regularizer.l2 * ops.sum(ops.square(weight))
            total = term if total is None else total + term
        return ops.zeros((), weight.dtype) if total is None else total
    return regularizer(weight)


def is_capture_safe(loss_fn, y_pred):
    """Whether `capture_safe_loss` computes `loss_fn` (not for a `__call__` override or a masked `y_pred`)."""
    overrides_call = type(loss_fn).__call__ is not keras.losses.Loss.__call__
    masked = any(_keras_private.keras_mask(t) is not None for t in tree.flatten(y_pred))
    return not overrides_call and not masked


def _match_rank(values, weight):
    values_rank, weight_rank = len(values.shape), len(weight.shape)
    if values_rank == weight_rank + 1 and values.shape[-1] == 1:
        if weight_rank == 1:
            weight = ops.expand_dims(weight, -1)
        else:
            values = ops.squeeze(values, -1)
    elif weight_rank == values_rank + 1 and weight.shape[-1] == 1:
        if values_rank == 1:
            values = ops.expand_dims(values, -1)
        else:
            weight = ops.squeeze(weight, -1)
    return values, weight


def capture_safe_loss(loss_fn, y_true, y_pred, sample_weight=None):
    """`loss_fn(y_true, y_pred, sample_weight)` as `Loss.__call__` computes it, dividing by Python constants."""
    dtype = loss_fn.dtype
    y_pred = tree.map_structure(lambda t: ops.cast(t, dtype), y_pred)
    y_true = tree.map_structure(lambda t: ops.cast(t, dtype), y_true)
    values = loss_fn.call(y_true, y_pred)
    if _keras_private.keras_mask(values) is not None:  # a masking loss: Keras's own path
        return loss_fn(y_true, y_pred, sample_weight=sample_weight)
    values = ops.cast(values, dtype)
    weight = None
    if sample_weight is not None:
        weight = ops.cast(sample_weight, values.dtype)
        values, weight = _match_rank(values, weight)
        values = values * weight
    reduction = loss_fn.reduction
    shape = tuple(values.shape)
    if reduction in (None, "none") or shape in ((), (0,)):
        return values
    total = ops.sum(values)
    if reduction not in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
        return total  # "sum"
    if reduction == "mean_with_sample_weight" and weight is not None:
        divisor = ops.sum(weight)
        nonzero = ops.cast(divisor != 0, total.dtype)
        return total * nonzero / (divisor + (1 - nonzero))  # divide_no_nan
    count = int(np.prod(shape))
    return total / count if count else total * 0
