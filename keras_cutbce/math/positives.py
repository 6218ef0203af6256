"""A row's positives: de-duplicated (`distinct_targets`), their logits (`item_logits`), the first.

Written with `keras.ops`, so it runs on native JAX, TensorFlow and torch
tensors (and under `jit` / `tf.function`). Memory is O(M x L): the ids of a
row are sorted, so a repeated id sits next to its first occurrence (no
`[M, L, L]` comparison); the logits of a row's L items are one gather of
their table rows, `[M, L, D]`. `first_item` picks the item a ranking puts
first (the rank metrics count the items above it).
"""

import keras
from keras import ops


def distinct_targets(ids, vocab_size):
    """Returns the valid, de-duplicated target ids of each row, sorted.

    Ids outside `[0, vocab_size)` are padding (compared in the ids' own
    dtype, so an int64 id >= 2**31 never wraps to a valid id).

    Args:
        ids: integer `[M, L]` (L may be 0).
        vocab_size: int, the number of items `V`.

    Returns:
        `(safe, keep)`: int32 `[M, L]` ids, sorted per row, where each kept
        id is a valid first occurrence and every other entry is 0; and the
        bool `[M, L]` mask of the kept entries.

    Example:

    >>> import numpy as np
    >>> safe, keep = distinct_targets(np.array([[3, -1, 3, 7, 1]]), 5)
    >>> np.asarray(ops.convert_to_numpy(safe)).tolist(), np.asarray(ops.convert_to_numpy(keep)).tolist()
    ([[0, 0, 1, 3, 0]], [[False, False, True, True, False]])
    """
    ids = ops.convert_to_tensor(ids)
    wide = keras.backend.standardize_dtype(ids.dtype) in ("int64", "uint32", "uint64")
    ids = ops.cast(ids, "int64" if wide else "int32")  # signed: -1 marks padding
    valid = ops.logical_and(ids >= 0, ids < vocab_size)
    key = ops.sort(ops.where(valid, ids, -1), axis=-1)  # (full_like reads a host scalar on torch)
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
    """Returns the float32 logits `[M, L]` of each row's items `h . E_id + b_id`.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        bias: optional float `[V]`.
        ids: int `[M, L]`; entries outside `[0, V)` read item 0 (mask them).

    Example:

    >>> import numpy as np
    >>> h, table = np.ones((1, 2), "float32"), np.array([[1, 0], [0, 3]], "float32")
    >>> np.asarray(ops.convert_to_numpy(item_logits(h, table, None, np.array([[1, 0]])))).tolist()
    [[3.0, 1.0]]
    """
    ids = ops.convert_to_tensor(ids)
    safe = ops.where(ops.logical_and(ids >= 0, ids < ops.shape(table)[0]), ids, 0)
    rows = ops.cast(ops.take(table, safe, axis=0), "float32")  # [M, L, D]
    logits = ops.sum(ops.expand_dims(ops.cast(hidden, "float32"), 1) * rows, axis=-1)
    if bias is not None:
        logits = logits + ops.cast(ops.take(bias, safe, axis=0), "float32")
    return logits


def first_item(logits, ids, keep):
    """Returns `(score [M], id [M])` of each row's first kept item: the highest logit, then the lower id.

    A row without a kept item gives `(-inf, -1)`; a row with a NaN logit
    among its kept items gives a NaN score.

    Example:

    >>> import numpy as np
    >>> z, ids = np.array([[2.0, 5.0, 5.0]], "float32"), np.array([[1, 9, 4]])
    >>> score, first = first_item(z, ids, np.array([[True, True, True]]))
    >>> float(ops.convert_to_numpy(score)[0]), int(ops.convert_to_numpy(first)[0])
    (5.0, 4)
    """
    logits, ids = ops.convert_to_tensor(logits), ops.cast(ids, "int32")
    keep = ops.convert_to_tensor(keep)
    if logits.shape[-1] == 0:  # no items (L = 0): a max has no identity
        zeros = ops.sum(logits, axis=1)
        return zeros - float("inf"), ops.cast(zeros, "int32") - 1
    nan = ops.any(ops.logical_and(keep, ops.isnan(logits)), axis=1)
    masked = ops.where(ops.logical_and(keep, ops.logical_not(ops.isnan(logits))), logits,
                       float("-inf"))
    best = ops.max(masked, axis=1)
    tied = ops.logical_and(keep, masked == ops.expand_dims(best, 1))
    none = 2**31 - 1
    first = ops.min(ops.where(tied, ids, none), axis=1)
    first = ops.where(first == none, -1, first)
    return ops.where(nan, float("nan"), best), first
