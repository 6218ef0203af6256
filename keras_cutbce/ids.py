"""Your item-id data: `multi_hot_to_ids`, `seen_items`, `count_out_of_range_ids`, and the id reader `integer_ids`."""

import numbers

import keras
import numpy as np
from keras import ops

from keras_cutbce.common import EMPTY_ID
from keras_cutbce.common import concrete_values
from keras_cutbce.common import filled_like
from keras_cutbce.common import is_host_array
from keras_cutbce.common import on_host_values
from keras_cutbce.item_table import ItemTable

__all__ = ["count_out_of_range_ids", "multi_hot_to_ids", "seen_items"]


def multi_hot_to_ids(labels, max_ids=None):
    """Multi-hot labels `[..., V]` as the integer target ids `[..., L]` CutBCE takes, padded with -1 (on the host).

    Args:
        labels: 0/1 labels `[..., V]` (bool, integer or float; NumPy, a list
            or an eager tensor).
        max_ids: optional int, L (default: the most any position has).

    Returns:
        An int32 NumPy array `[..., L]`, each position's items in increasing order.

    Raises:
        ValueError: a position with more than `max_ids` items.

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
    """The items each position of a sequence has seen, as `exclude_ids [..., T, T]` for `cut_top_k`.

    Args:
        sequences: integer item ids `[..., T]`, NumPy or a tensor.
        causal: position t excludes `sequences[..., :t + 1]` (else all of them).

    Returns:
        Ids `[..., T, T]`, -1 in the other slots: NumPy for NumPy input, else a tensor.

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
    return ops.where(keep, ids, filled_like(ids, EMPTY_ID))


# The largest V whose ids are all exact in a float dtype, capped at float32's (Keras's losses cast labels to it).
_EXACT_FLOAT_IDS = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**24}
_ID_LIMIT = 2**30  # float ids are clipped to [-_ID_LIMIT, _ID_LIMIT] (outside any V <= 2**24) before the cast


def whole_float_ids(ids, vocab_size, argument):
    """Float ids as integers, as Keras's `SparseCategoricalCrossentropy` takes them, where that is exact.

    Accepted while every id below V is a float of their dtype (V <= 2**24 for
    float32); readable values (host data, eager CPU tensors) must be whole
    numbers, traced ones are cast (truncated) as Keras casts them. Values keep
    their meaning: ids outside `[0, V)` stay outside.

    Returns:
        int64 NumPy ids for host data, else an int32 tensor.

    Raises:
        TypeError: V unknown or above the dtype's exact range.
        ValueError: a readable id that is not a whole number.
    """
    host = is_host_array(ids)
    dtype = str(np.asarray(ids).dtype) if host else keras.backend.standardize_dtype(ids.dtype)
    limit = _EXACT_FLOAT_IDS.get(dtype)
    if limit is None:
        raise TypeError(
            f"`{argument}` must be integer item ids (ids outside [0, V) are padding). "
            f"Received: {argument}.dtype={dtype}"
        )
    if not isinstance(vocab_size, numbers.Integral) or vocab_size > limit:
        shown = "unknown" if not isinstance(vocab_size, numbers.Integral) else vocab_size
        raise TypeError(
            f"`{argument}` must be integer item ids (ids outside [0, V) are padding): float "
            f"ids are taken only while every id below V is exact ({dtype}: V <= "
            f"{limit}; V here: {shown}), so keep them integral. "
            f"Received: {argument}.dtype={dtype}"
        )
    values = on_host_values(ids)
    if values is not None:
        whole = np.isfinite(values) & (values == np.floor(values))
        if not whole.all():
            bad = np.unique(values[~whole])[:4].tolist()
            raise ValueError(
                f"`{argument}` must be whole-number item ids (float ids are cast to integers, "
                f"so {bad[0]!r} would be read as another item). Received: {argument} with "
                f"values {bad}"
            )
    if host:
        return np.clip(values, -_ID_LIMIT, _ID_LIMIT).astype(np.int64)
    return ops.cast(ops.clip(ids, -_ID_LIMIT, _ID_LIMIT), "int32")


def integer_ids(ids, vocab_size, argument):
    """`(ids, host)`: integer ids, host data as NumPy (`host` True), else a tensor; float ids as `whole_float_ids` takes them.

    The one reader of item ids for the losses, the metrics and `count_out_of_range_ids`.
    """
    host = is_host_array(ids)
    ids = np.asarray(ids) if host else ops.convert_to_tensor(ids)
    if not (ids.dtype.kind in "iu" if host else keras.backend.is_int_dtype(ids.dtype)):
        ids = whole_float_ids(ids, vocab_size, argument)  # TypeError where floats are not exact
    return ids, host


def count_out_of_range_ids(ids, embeddings) -> dict[int, int]:
    """The ids outside `[0, V)`, which the loss and the metrics read as padding: a check for off-by-one data.

    Args:
        ids: integer ids of any shape (NumPy, a list or a tensor).
        embeddings: the item table (layer, variable, array or tensor) or V.

    Returns:
        A dict `{id: count}` sorted by id (empty when all ids are items).

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
    values, _ = integer_ids(ids if is_host_array(ids) else ops.convert_to_numpy(ids), vocab_size, "ids")
    outside = values[(values < 0) | (values >= vocab_size)]
    found, counts = np.unique(outside, return_counts=True)
    return {int(i): int(c) for i, c in zip(found, counts)}
