"""The public ops: check the inputs once (`checks`), run the registry's choice (`registry`)."""

from typing import Optional

import keras  # noqa: F401 - the examples below use it
from keras import ops

from keras_cutbce import checks
from keras_cutbce.common import filled_like
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import static_vocab_size
from keras_cutbce.math.positives import first_item
from keras_cutbce.registry import dispatch
from keras_cutbce.registry import run_loss

__all__ = [
    "cut_binary_crossentropy",
    "cut_count_at_least",
    "cut_rank",
    "cut_top_k",
    "weighted_loss_sum",
]

def cut_binary_crossentropy(
    hidden,
    embeddings,
    target_ids,
    bias=None,
    *,
    label_smoothing: float = 0.0,
    pos_weight: float = 1.0,
    chunk_size: Optional[int] = None,
    implementation: str = "auto",
):
    """The per-position binary cross-entropy over the full vocabulary, without the logits.

    `keras.losses.binary_crossentropy(multi_hot, h @ E.T + b, from_logits=True,
    label_smoothing=...)` averaged over the V items, with `pos_weight` on the
    positive terms; exact gradients for any cotangent.

    Args:
        hidden: float `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]`: a tensor, a `keras.Variable`, or a
            layer with `embeddings` (`Embedding`, LoRA too, `ItemEmbedding`,
            whose own bias is used).
        target_ids: integer ids `[..., L]` (or `[...]`, one a position); ids
            outside `[0, V)` are padding, duplicates count once.
        bias: optional float `[V]`, for a table without its own bias.
        label_smoothing: float in `[0, 1]`.
        pos_weight: finite float > 0, the weight of the positive terms.
        chunk_size: vocabulary tile width; `None`: the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX), `"triton"`
            (torch) or `"reference"` (dense); a table split along V over a JAX
            mesh runs the sharded kernel.

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`.

    Raises:
        ValueError, TypeError: a checked argument is out of its domain.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(2, 3, 8)).astype("float32")
    >>> table = np.random.normal(size=(100, 8)).astype("float32")
    >>> loss = cut_binary_crossentropy(h, table, np.array([[[1, 2], [3, -1], [5, 5]]] * 2))
    >>> tuple(loss.shape), keras.backend.standardize_dtype(loss.dtype)
    ((2, 3), 'float32')
    """
    options = checks.loss_options(label_smoothing, pos_weight, chunk_size, implementation)
    inputs = checks.loss_inputs(hidden, embeddings, target_ids, bias)
    return run_loss(options.op, options.implementation, inputs, **options.keywords)


def weighted_loss_sum(
    hidden,
    embeddings,
    target_ids,
    row_weights,
    bias=None,
    *,
    label_smoothing: float = 0.0,
    pos_weight: float = 1.0,
    chunk_size: Optional[int] = None,
    implementation: str = "auto",
):
    """`sum(row_weights * cut_binary_crossentropy(...))`, the gradients computed with the loss where fused.

    `row_weights` (shape `hidden.shape[:-1]`) are constants; the other
    arguments are `cut_binary_crossentropy`'s.

    >>> import numpy as np
    >>> h, table = np.ones((2, 4), "float32"), np.ones((10, 4), "float32")
    >>> round(float(weighted_loss_sum(h, table, np.array([[1], [2]]), np.array([0.5, 0.5]))), 3)
    3.618
    """
    options = checks.loss_options(label_smoothing, pos_weight, chunk_size, implementation)
    inputs = checks.loss_inputs(hidden, embeddings, target_ids, bias)
    return run_loss(options.op, options.implementation, inputs, row_weights=row_weights,
                    **options.keywords)


# -- retrieval --------------------------------------------------------------------


def _prepare_retrieval(hidden, embeddings, bias, chunk_size):
    chunk_size = checks.check_chunk_size(chunk_size)
    hidden = ops.convert_to_tensor(hidden)
    table = ItemTable.read(embeddings)
    bias = checks.read_bias(table, bias)
    checks.check_hidden_and_table(hidden, table.value, bias)
    return hidden, table, bias, chunk_size


def _exclusions(exclude_ids, hidden, vocab_size):
    if exclude_ids is None:
        return None
    ids = checks.int32_ids(exclude_ids, hidden, vocab_size, "exclude_ids", one_per_position=False)
    return checks.flat_rows(hidden, ids)[1]


def cut_top_k(
    hidden,
    embeddings,
    k: int,
    bias=None,
    exclude_ids=None,
    chunk_size: Optional[int] = None,
):
    """The top-k items per position, without the `[positions, V]` logits (ties to the lower id).

    Args:
        hidden: float `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (as in `cut_binary_crossentropy`).
        k: an int in `[1, V]`.
        bias: optional float `[V]`, for a table without its own bias.
        exclude_ids: optional integer ids `[..., X]` never returned for that
            position (`keras_cutbce.seen_items`); ids outside `[0, V)` ignored.
        chunk_size: vocabulary tile width; `None`: the default rule.

    Returns:
        `(scores, ids)`: float32 `[..., k]` logits sorted descending and int32
        ids (`EMPTY_ID` where fewer than k items remain); NaN scores and
        `EMPTY_ID` for a position with a NaN logit.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(4, 8)).astype("float32")
    >>> scores, ids = cut_top_k(h, np.random.normal(size=(50, 8)).astype("float32"), k=5)
    >>> tuple(ids.shape)
    (4, 5)
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    k = checks.check_k(k, static_vocab_size(table))
    exclusions = _exclusions(exclude_ids, hidden, table.vocab_size)
    lead_shape = tuple(ops.shape(hidden)[:-1])
    flat_hidden, _ = checks.flat_rows(hidden)
    scores, ids = dispatch(
        "top_k", "chunked", flat_hidden, table, k, bias, exclusions, chunk_size=chunk_size
    )
    scores, ids = ops.cast(scores, "float32"), ops.cast(ids, "int32")
    return ops.reshape(scores, lead_shape + (k,)), ops.reshape(ids, lead_shape + (k,))


def cut_rank(hidden, embeddings, item_ids, bias=None, exclude_ids=None, chunk_size=None):
    """The rank of each position's first item (highest logit, then lower id) in its full ranking, without logits.

    Args:
        hidden: float `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (as in `cut_binary_crossentropy`).
        item_ids: integer ids `[..., L]` (or `[...]`); ids outside `[0, V)` are padding.
        bias: optional float `[V]`, for a table without its own bias.
        exclude_ids: optional integer ids `[..., X]` out of the ranking.
        chunk_size: vocabulary tile width; `None`: the default rule.

    Returns:
        Int32 ranks of shape `hidden.shape[:-1]` in `[1, V]` (`cut_top_k`'s
        order); 0 without a valid item; -1 for a position with a NaN logit.

    Example:

    >>> import numpy as np
    >>> table = np.array([[1, 0], [0, 3], [1, 1], [2, 0]], "float32")   # logits 1, 3, 2, 2
    >>> np.asarray(cut_rank(np.ones((1, 2), "float32"), table, [[3, 0]])).tolist()   # ties item 2
    [3]
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    vocab_size = table.vocab_size
    ids = checks.int32_ids(item_ids, hidden, vocab_size, "item_ids")
    exclusions = _exclusions(exclude_ids, hidden, vocab_size)
    flat_hidden, flat_ids = checks.flat_rows(hidden, ids)
    keep = ops.logical_and(flat_ids >= 0, flat_ids < vocab_size)
    if exclusions is not None:
        excluded = ops.expand_dims(flat_ids, 2) == ops.expand_dims(exclusions, 1)  # [M, L, X]
        keep = ops.logical_and(keep, ops.logical_not(ops.any(excluded, axis=2)))
    logits = table.item_logits(flat_hidden, bias, flat_ids)
    score, first = first_item(logits, flat_ids, keep)
    above = dispatch("count_above", "chunked", flat_hidden, table, bias, score, first,
                     exclusions, chunk_size=chunk_size)
    above = ops.cast(above, "int32")
    ranks = ops.where(first < 0, ops.zeros_like(above), above + 1)
    ranks = ops.where(ops.logical_or(above < 0, ops.isnan(score)), filled_like(ranks, -1), ranks)
    return ops.reshape(ranks, ops.shape(hidden)[:-1])


def cut_count_at_least(hidden, embeddings, threshold, bias=None, chunk_size=None):
    """The number of items whose logit is `>= threshold`, per position, without logits.

    Args:
        hidden: float `[..., D]`.
        embeddings: item table `[V, D]` (as in `cut_binary_crossentropy`).
        threshold: float logit threshold.
        bias: optional float `[V]`, for a table without its own bias.
        chunk_size: vocabulary tile width; `None`: the default rule.

    Returns:
        Int32 counts of shape `hidden.shape[:-1]`; -1 for a position with a NaN logit.

    Example:

    >>> import numpy as np
    >>> table = np.array([[1, 1, 1], [-1, -1, -1], [1, 0, 0]], "float32")
    >>> np.asarray(cut_count_at_least(np.ones((2, 3), "float32"), table, 0.5)).tolist()
    [2, 2]
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    lead_shape = ops.shape(hidden)[:-1]
    flat_hidden, _ = checks.flat_rows(hidden)
    rows = ops.ones_like(flat_hidden[:, 0], dtype="float32")
    # At (threshold, V) every logit >= threshold ranks above: no item has id V.
    counts = dispatch(
        "count_above", "chunked", flat_hidden, table, bias, rows * float(threshold),
        ops.cast(rows, "int32") * table.vocab_size, None, chunk_size=chunk_size,
    )
    return ops.reshape(ops.cast(counts, "int32"), lead_shape)
