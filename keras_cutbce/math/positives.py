"""A row's positives (`distinct_targets`), their logits, the first (`first_item`), in `keras.ops`, O(M L)."""

import keras
from keras import ops

from keras_cutbce.common import filled_like


def distinct_targets(ids, vocab_size):
    """`(safe, keep)`: int32 `[M, L]` ids sorted per row (0 where not kept) and the mask of the valid first ones.

    Ids outside `[0, vocab_size)` are padding, compared in their own dtype.
    """
    ids = ops.convert_to_tensor(ids)
    wide = keras.backend.standardize_dtype(ids.dtype) in ("int64", "uint32", "uint64")
    ids = ops.cast(ids, "int64" if wide else "int32")  # signed: -1 marks padding
    valid = ops.logical_and(ids >= 0, ids < vocab_size)
    key = ops.sort(ops.where(valid, ids, filled_like(ids, -1)), axis=-1)
    length = ids.shape[-1]
    if length is not None and length <= 1:
        keep = key >= 0
    else:
        changed = ops.not_equal(key[:, 1:], key[:, :-1])
        first = ops.concatenate([ops.ones_like(key[:, :1], dtype="bool"), changed], axis=1)
        keep = ops.logical_and(first, key >= 0)
    safe = ops.cast(ops.where(keep, key, ops.zeros_like(key)), "int32")
    return safe, keep


def item_logits(hidden, table, bias, ids):
    """The float32 logits `[M, L]` of each row's items `h . E_id + b_id` (ids outside `[0, V)` read item 0)."""
    ids = ops.convert_to_tensor(ids)
    safe = ops.where(ops.logical_and(ids >= 0, ids < ops.shape(table)[0]), ids, ops.zeros_like(ids))
    rows = ops.cast(ops.take(table, safe, axis=0), "float32")  # [M, L, D]
    logits = ops.sum(ops.expand_dims(ops.cast(hidden, "float32"), 1) * rows, axis=-1)
    if bias is not None:
        logits = logits + ops.cast(ops.take(bias, safe, axis=0), "float32")
    return logits


def first_item(logits, ids, keep):
    """`(score [M], id [M])` of each row's first kept item (highest logit, then lower id); `(-inf, -1)` if none."""
    logits, ids = ops.convert_to_tensor(logits), ops.cast(ids, "int32")
    keep = ops.convert_to_tensor(keep)
    if logits.shape[-1] == 0:  # no items (L = 0): a max has no identity
        zeros = ops.sum(logits, axis=1)
        return zeros - float("inf"), ops.cast(zeros, "int32") - 1
    nan = ops.any(ops.logical_and(keep, ops.isnan(logits)), axis=1)
    masked = ops.where(ops.logical_and(keep, ops.logical_not(ops.isnan(logits))), logits,
                       filled_like(logits, float("-inf")))
    best = ops.max(masked, axis=1)
    tied = ops.logical_and(keep, masked == ops.expand_dims(best, 1))
    none = 2**31 - 1
    first = ops.min(ops.where(tied, ids, filled_like(ids, none)), axis=1)
    first = ops.where(first == none, filled_like(first, -1), first)
    return ops.where(nan, filled_like(best, float("nan")), best), first
