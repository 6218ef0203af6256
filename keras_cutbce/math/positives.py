"""Target de-duplication, one sort-based method for every backend and the metrics.

Written with `keras.ops`, so it runs on native JAX, TensorFlow and torch
tensors (and under `jit` / `tf.function`). Memory is O(M x L): the ids of a
row are sorted, so a repeated id sits next to its first occurrence (no
`[M, L, L]` comparison).
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
