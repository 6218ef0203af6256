"""Your item-id data: the forms CutBCE takes, and the helpers that convert and check it.

CutBCE's targets are integer item ids `[..., L]` a position (padded with ids
outside `[0, V)`, e.g. -1), and its exclusions are ids `[..., X]` a position.

- `multi_hot_to_ids`: multi-hot labels `[..., V]` (the dense binary
  cross-entropy form) as ids `[..., L]` padded with -1;
- `seen_items`: the items each position of a sequence has seen, as
  `exclude_ids [..., T, T]` (retrieval that excludes a user's history);
- `count_out_of_range_ids`: the ids outside `[0, V)`, which the loss and the
  metrics read as padding;
- `refuse_multi_hot`: the check that stops multi-hot labels given as ids
  (called by `keras_cutbce.checks.int32_ids` and `OutOfRangeTargets`).
"""

import numbers

import numpy as np
from keras import ops

from keras_cutbce.common import EMPTY_ID
from keras_cutbce.common import concrete_values
from keras_cutbce.common import is_host_array
from keras_cutbce.item_table import ItemTable

__all__ = ["count_out_of_range_ids", "multi_hot_to_ids", "refuse_multi_hot", "seen_items"]


def multi_hot_to_ids(labels, max_ids=None):
    """Converts multi-hot labels `[..., V]` into the integer target ids `[..., L]` CutBCE takes.

    Each position's items (the indices of its ones) in increasing order,
    padded with -1 to `L` ids: the most any position has, or `max_ids`.
    Convert your data once, before `fit` (a data step, on the host).

    Args:
        labels: 0/1 labels `[..., V]` (bool, integer or float; NumPy, a list
            or an eager tensor).
        max_ids: optional int, L; a position with more items raises.

    Returns:
        An int32 NumPy array `[..., L]`.

    Example:

    >>> multi_hot_to_ids([[0, 1, 0, 1], [0, 0, 0, 0]]).tolist()
    [[1, 3], [-1, -1]]
    """
    values = concrete_values(labels)
    if values is None:
        raise TypeError(
            "`labels` must be data whose values can be read (NumPy, a list or an eager "
            "tensor): convert your targets once, before training. Received: a traced "
            f"{type(labels).__name__}"
        )
    if values.ndim < 1 or not np.isin(values, (0, 1)).all():
        raise ValueError(
            "`labels` must be multi-hot labels [..., V] of 0 and 1 (soft labels have no "
            "ids: train on the ids with `label_smoothing=`). Received: labels of shape "
            f"{values.shape} with values {np.unique(values)[:6].tolist()}"
        )
    flat = values.reshape(-1, values.shape[-1]) == 1
    rows, columns = np.nonzero(flat)  # row-major: each row's columns in increasing order
    counts = flat.sum(axis=1)
    most = int(counts.max(initial=0))
    if max_ids is None:
        max_ids = max(most, 1)
    elif isinstance(max_ids, bool) or not isinstance(max_ids, numbers.Integral) or max_ids < 1:
        raise ValueError(f"`max_ids` must be None or an int >= 1. Received: max_ids={max_ids!r}")
    if most > max_ids:
        raise ValueError(
            f"`max_ids` must be at least the most items a position has ({most}). "
            f"Received: max_ids={max_ids}"
        )
    ids = np.full((flat.shape[0], int(max_ids)), EMPTY_ID, np.int32)
    ids[rows, np.arange(len(rows)) - np.searchsorted(rows, rows)] = columns
    return ids.reshape(values.shape[:-1] + (int(max_ids),))


def seen_items(sequences, causal=True):
    """Returns the items each position of a sequence has seen, as `exclude_ids [..., T, T]`.

    Position t of `sequences [..., T]` excludes `sequences[..., :t + 1]`
    (`causal`, what a next-item model has seen at t) or all of
    `sequences[...]` (`causal=False`); the other slots are -1 (padding).
    Give it to `cut_top_k(..., exclude_ids=...)` or
    `TopKRetrieval.update_state(..., exclude_ids=...)` with hidden states
    `[..., T, D]`. Padding ids in `sequences` stay padding.

    Args:
        sequences: integer item ids `[..., T]`, NumPy or a tensor (traced
            tensors too).
        causal: whether position t excludes only the first t + 1 items.

    Returns:
        Ids `[..., T, T]`: NumPy for NumPy input, else a tensor.

    Example:

    >>> seen_items([[4, 7, 9]]).tolist()
    [[[4, -1, -1], [4, 7, -1], [4, 7, 9]]]
    """
    if is_host_array(sequences):
        values = np.asarray(sequences)
        if values.dtype.kind not in "iu" or values.ndim < 1:
            raise TypeError(
                "`sequences` must be integer item ids [..., T]. "
                f"Received: sequences.dtype={values.dtype}, shape={values.shape}"
            )
        values = values.astype(np.int64) if values.dtype.kind == "u" else values
        steps = values.shape[-1]
        ids = np.broadcast_to(values[..., None, :], values.shape[:-1] + (steps, steps))
        keep = np.tril(np.ones((steps, steps), bool)) if causal else np.ones((steps, steps), bool)
        return np.where(keep, ids, EMPTY_ID).astype(values.dtype)
    values = ops.convert_to_tensor(sequences)
    steps = values.shape[-1]
    ids = ops.expand_dims(values, -2) + ops.zeros_like(ops.expand_dims(values, -1))
    if not causal:
        return ids
    keep = ops.arange(steps)[None, :] <= ops.arange(steps)[:, None]
    return ops.where(keep, ids, ops.full_like(ids, EMPTY_ID))


def refuse_multi_hot(ids, vocab_size, argument, lead_ndim):
    """Raises on multi-hot labels `[..., V]` given as ids, which would read as the ids 0 and 1.

    Ids of rank `lead_ndim + 1` whose last axis has V >= 2 entries, all 0 or
    1, are refused; V ids a position holding other values pass. Where the
    values cannot be read (a traced tensor inside a compiled step: `fit` on
    JAX and TensorFlow) the shape alone decides.
    """
    dims = tuple(ids.shape)
    if not isinstance(vocab_size, int) or vocab_size < 2 or len(dims) != lead_ndim + 1:
        return
    if dims[-1] is None or int(dims[-1]) != vocab_size:
        return
    values = concrete_values(ids)
    if values is not None and not np.isin(values, (0, 1)).all():
        return
    seen = "its values are all 0 or 1" if values is not None else (
        "inside a compiled step its values cannot be read, so the shape decides (for V item "
        "ids a position, pad each list with one -1 so that L != V)"
    )
    shape = tuple(None if d is None else int(d) for d in dims)
    raise ValueError(
        f"`{argument}` looks like multi-hot labels [..., V] (the dense binary cross-entropy "
        f"form): its last axis has V = {vocab_size} entries and {seen}. CutBCE takes the "
        "integer ids of each position's items [..., L], padded with -1, and would read 0/1 "
        "labels as the ids 0 and 1: convert them with `keras_cutbce.multi_hot_to_ids(labels)`. "
        f"Received: {argument}.shape={shape}"
    )


def count_out_of_range_ids(ids, embeddings) -> dict[int, int]:
    """Counts the ids outside `[0, V)`, which the loss and metrics treat as padding.

    A debug check for target ids before training: by design every id outside
    `[0, V)` is padding (ignored), so an off-by-one (1-based ids `1..V` with a
    table of V rows) loses item V silently. Your padding id (e.g. -1) is
    listed too; any other entry is a real item the loss would ignore.

    Args:
        ids: integer ids of any shape (NumPy, a list, or a tensor of the
            active backend).
        embeddings: the item table (a layer, `keras.Variable`, array or
            tensor `[V, D]`) or V itself, an int.

    Returns:
        A dict `{id: count}` of every distinct id outside `[0, V)`, sorted by
        id (empty when all ids are items).

    Example:

    >>> count_out_of_range_ids([[1, 2, 3], [3, -1, 0]], 3)  # V = 3
    {-1: 1, 3: 2}
    """
    if isinstance(embeddings, numbers.Integral) and not isinstance(embeddings, bool):
        if embeddings < 1:
            raise ValueError(
                f"`embeddings` must be an int >= 1. Received: embeddings={embeddings!r}"
            )
        vocab_size = int(embeddings)
    else:
        vocab_size = int(ItemTable.read(embeddings).vocab_size)
    values = np.asarray(ids if is_host_array(ids) else ops.convert_to_numpy(ids))
    if values.dtype.kind not in "iu":
        raise TypeError(f"`ids` must be integer item ids. Received: ids.dtype={values.dtype}")
    outside = values[(values < 0) | (values >= vocab_size)]
    found, counts = np.unique(outside, return_counts=True)
    return {int(i): int(c) for i, c in zip(found, counts)}
