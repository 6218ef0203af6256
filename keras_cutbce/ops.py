"""Public CutBCE ops: check and normalise the inputs once, then run the registry's kernel.

Each op checks its arguments (`keras_cutbce.checks`), reads the item table
into one `ItemTable` (`keras_cutbce.item_table`), turns the ids into int32
with one padding id (`EMPTY_ID`), flattens to 2-D and calls the function
`keras_cutbce.registry.dispatch` chooses for the op and the implementation
(the kernel contract is written there). The kernels trust their inputs.
"""

from typing import NamedTuple
from typing import Optional

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import resolve_bias
from keras_cutbce.math.positives import first_item
from keras_cutbce.math.positives import item_logits
from keras_cutbce.registry import dispatch

__all__ = [
    "cut_binary_crossentropy",
    "cut_count_at_least",
    "cut_rank",
    "cut_top_k",
    "weighted_loss_sum",
]

def _flatten(hidden, ids=None):
    d = ops.shape(hidden)[-1]
    flat_hidden = ops.reshape(hidden, (-1, d))
    if ids is None:
        return flat_hidden, None
    return flat_hidden, ops.reshape(ids, (ops.shape(flat_hidden)[0], ops.shape(ids)[-1]))


def _read_bias(table, bias):
    """The bias value a call uses: `bias=`, or the bias the table layer owns (None without)."""
    bias = resolve_bias(table, bias)
    return None if bias is None else ItemTable.read(bias, "bias").value


# -- the loss ---------------------------------------------------------------------


class LossInputs(NamedTuple):
    """Checked, flattened tensors of the loss ops."""

    hidden: object
    table: ItemTable
    ids: object
    bias: Optional[object]
    lead_shape: tuple


def loss_inputs(hidden, embeddings, target_ids, bias=None):
    """Returns the loss ops' tensors checked and flattened to 2-D, as `LossInputs`.

    `embeddings` and `bias` may be given as `ItemTable`s (used as they are).
    The scalar options are checked separately (`checks.loss_options`), so a
    caller that holds checked options (`CutBCELoss`) checks only the tensors
    of each call.
    """
    hidden = ops.convert_to_tensor(hidden)
    table = ItemTable.read(embeddings)
    bias = _read_bias(table, bias)
    checks.check_hidden_and_table(hidden, table.value, bias)
    ids = checks.int32_ids(target_ids, hidden, table.vocab_size, "target_ids")
    flat_hidden, flat_ids = _flatten(hidden, ids)
    return LossInputs(flat_hidden, table, flat_ids, bias, ops.shape(hidden)[:-1])


# The per-row op of each loss family (its fused reduction: the name + "_weighted_sum").
_LOSS_OPS = {"bce": "cut_bce", "softmax": "cut_softmax"}


def _loss_kwargs(options):
    kwargs = {"chunk_size": options.chunk_size, "label_smoothing": options.label_smoothing}
    if options.family == "bce":
        kwargs["pos_weight"] = options.pos_weight
    return kwargs


def per_position_loss(inputs, options):
    """Returns the flat float32 `[M]` loss of checked `LossInputs` and `LossOptions`."""
    op = _LOSS_OPS[options.family]
    loss = dispatch(op, options.implementation, inputs.hidden, inputs.table, inputs.ids,
                    inputs.bias, **_loss_kwargs(options))
    if loss is None:
        raise NotImplementedError(
            f"{op!r} has no implementation for this table yet (a table split over a mesh "
            f"runs the BCE loss only). Received: implementation={options.implementation!r}"
        )
    return ops.cast(loss, "float32")


def loss_sum(inputs, options, row_weights):
    """Returns `sum(row_weights * loss)` of checked `LossInputs` and `LossOptions`, float32.

    `row_weights` (shape `hidden.shape[:-1]`) are constants: no gradient.
    """
    weights = ops.reshape(
        ops.stop_gradient(ops.cast(row_weights, "float32")), (ops.shape(inputs.hidden)[0],)
    )
    total = dispatch(
        _LOSS_OPS[options.family] + "_weighted_sum", options.implementation, inputs.hidden,
        inputs.table, inputs.ids, inputs.bias, weights, **_loss_kwargs(options),
    )
    if total is None:  # no fused kernel on this implementation
        return ops.sum(weights * per_position_loss(inputs, options))
    return ops.cast(total, "float32")


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
    """Computes the per-position binary cross-entropy over the full vocabulary, without logits.

    For each position with hidden state `h`, logits `z = h @ E.T + b` and the
    multi-hot target of its ids, returns
    `mean_v[(1 + (p - 1) y'_v) softplus(z_v) - p y'_v z_v]` with
    `y' = y (1 - label_smoothing) + label_smoothing / 2` and `p = pos_weight`:
    the value of `keras.losses.binary_crossentropy(multi_hot, z,
    from_logits=True, label_smoothing=...)`, computed tile by tile over the
    vocabulary so the `[positions, V]` logits never exist. Gradients for
    `hidden`, the table and `bias` are exact for any cotangent.

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]`, `V >= 1`: a tensor, a
            `keras.Variable`, or a layer with an `embeddings` variable
            (`keras.layers.Embedding`, LoRA-enabled too,
            `keras_cutbce.ItemEmbedding`, whose own bias is used).
        target_ids: integer ids `[..., L]` (or `[...]` for one id a position),
            of any integer dtype. Ids outside `[0, V)` are padding (int64 ids
            beyond the int32 range too); duplicates count once.
        bias: optional float `[V]`, for a table without its own bias.
        label_smoothing: float in `[0, 1]`.
        pos_weight: finite float > 0 weighting the positive terms.
        chunk_size: vocabulary tile width (an int, NumPy ints accepted);
            `None` uses `keras_cutbce.math.tiling.default_chunk_size`.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX only),
            `"triton"` (torch only: the fused Triton kernels, which `"auto"`
            runs for CUDA tensors when Triton is installed) or
            `"reference"` (dense, for tests and debugging). With `"auto"` or
            `"chunked"` on JAX, a table split along V over a mesh runs the
            vocab-sharded kernel (`keras_cutbce.backends.jax.sharded`).

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`, whatever the input dtypes
        (float64 and bfloat16 inputs included), on every backend.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(2, 3, 8)).astype("float32")
    >>> table = np.random.normal(size=(100, 8)).astype("float32")
    >>> ids = np.array([[[1, 2], [3, -1], [5, 5]]] * 2)
    >>> loss = cut_binary_crossentropy(h, table, ids)
    >>> tuple(loss.shape), keras.backend.standardize_dtype(loss.dtype)
    ((2, 3), 'float32')
    """
    options = checks.loss_options(label_smoothing, pos_weight, chunk_size, implementation)
    inputs = loss_inputs(hidden, embeddings, target_ids, bias)
    return ops.reshape(per_position_loss(inputs, options), inputs.lead_shape)


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
    """Computes `sum(row_weights * cut_binary_crossentropy(...))`: the scalar a reduced loss needs.

    `CutBCELoss` reduces per-position losses with known weights (sample
    weights, masks, the reduction's divisor), so only this scalar is
    differentiated, and the gradient for any upstream cotangent `c` is `c`
    times the gradient at `c = 1`. Implementations with a fused kernel
    (`cut_bce_weighted_sum`) compute that gradient in the same pass over the
    vocabulary as the loss (one logits matmul and one `exp` per logit instead
    of two); the others reduce `cut_binary_crossentropy`. `row_weights`
    (shape `hidden.shape[:-1]`) are constants: no gradient. The other
    arguments are those of `cut_binary_crossentropy`.

    Example:

    >>> import numpy as np
    >>> h = np.ones((2, 4), "float32"); table = np.ones((10, 4), "float32")
    >>> ids = np.array([[1], [2]])
    >>> round(float(weighted_loss_sum(h, table, ids, np.array([0.5, 0.5]))), 3)
    3.618
    """
    options = checks.loss_options(label_smoothing, pos_weight, chunk_size, implementation)
    inputs = loss_inputs(hidden, embeddings, target_ids, bias)
    return loss_sum(inputs, options, row_weights)


# -- retrieval --------------------------------------------------------------------


def _prepare_retrieval(hidden, embeddings, bias, chunk_size):
    chunk_size = checks.check_chunk_size(chunk_size)
    hidden = ops.convert_to_tensor(hidden)
    table = ItemTable.read(embeddings)
    bias = _read_bias(table, bias)
    checks.check_hidden_and_table(hidden, table.value, bias)
    return hidden, table, bias, chunk_size


def _exclusions(exclude_ids, hidden, vocab_size):
    """`exclude_ids [..., X]` checked and flattened to `[M, X]` (None stays None)."""
    if exclude_ids is None:
        return None
    ids = checks.int32_ids(exclude_ids, hidden, vocab_size, "exclude_ids", one_per_position=False)
    return _flatten(hidden, ids)[1]


def cut_top_k(
    hidden,
    embeddings,
    k: int,
    bias=None,
    exclude_ids=None,
    chunk_size: Optional[int] = None,
):
    """Returns the top-k items per position without the `[positions, V]` logits.

    Keeps a running top-k merged tile by tile over the vocabulary, so memory
    is O(positions x (k + tile)). Exact against a dense `top_k` of
    `hidden @ E.T + bias`, ties broken by the lower id. A position any of
    whose V logits is NaN (a NaN hidden state, a NaN table row) has no
    ranking: NaN scores and ids `EMPTY_ID` (-1), on every backend.

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (tensor, variable or Embedding layer;
            an `ItemEmbedding` with `use_bias=True` gives its bias too).
        k: number of items to return, an int in `[1, V]` (NumPy ints too).
        bias: optional float `[V]`, for a table without its own bias.
        exclude_ids: optional integer ids `[..., X]` never returned for that
            position: X ids a position, with the leading dimensions of
            `hidden` (`keras_cutbce.seen_items(sequences)` gives each
            position of a sequence the items seen up to it). Ids outside
            `[0, V)` (int64 ids beyond the int32 range too) are ignored.
        chunk_size: vocabulary tile width; `None` uses the default rule.

    Returns:
        `(scores, ids)`: float32 `[..., k]` logits sorted descending and int32
        `[..., k]` item ids (`EMPTY_ID` where fewer than k items remain).

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(4, 8)).astype("float32")
    >>> table = np.random.normal(size=(50, 8)).astype("float32")
    >>> scores, ids = cut_top_k(h, table, k=5)
    >>> tuple(ids.shape)
    (4, 5)
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    k = checks.check_k(k, checks.static_dims(table.value)[0])
    exclusions = _exclusions(exclude_ids, hidden, table.vocab_size)
    lead_shape = tuple(ops.shape(hidden)[:-1])
    flat_hidden, _ = _flatten(hidden)
    scores, ids = dispatch(
        "top_k", "chunked", flat_hidden, table, k, bias, exclusions, chunk_size=chunk_size
    )
    scores, ids = ops.cast(scores, "float32"), ops.cast(ids, "int32")
    return ops.reshape(scores, lead_shape + (k,)), ops.reshape(ids, lead_shape + (k,))


def cut_rank(hidden, embeddings, item_ids, bias=None, exclude_ids=None, chunk_size=None):
    """Returns the rank of each position's first item in its full ranking, without logits.

    Of the position's items (`item_ids`, e.g. its targets) the first is the
    one its ranking puts highest (the highest logit, then the lower id); its
    rank is 1 + the number of items ranked above it: a higher logit, or an
    equal logit and a lower id (the order of `cut_top_k`), counted tile by
    tile over the vocabulary. Excluded items are out of the ranking, and
    never the first item. The items' own logits are one gather of their
    table rows (they agree with the tiles' products to float rounding).

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (tensor, variable or layer).
        item_ids: integer ids `[..., L]` (or `[...]`, one a position); ids
            outside `[0, V)` are padding.
        bias: optional float `[V]`, for a table without its own bias.
        exclude_ids: optional integer ids `[..., X]` out of the position's
            ranking (as in `cut_top_k`).
        chunk_size: vocabulary tile width; `None` uses the default rule.

    Returns:
        Int32 ranks of shape `hidden.shape[:-1]`: in `[1, V]`; 0 for a
        position without a valid item outside its exclusions; -1 for a
        position any of whose logits is NaN (no ranking).

    Example:

    >>> import numpy as np
    >>> h = np.ones((1, 2), "float32")
    >>> table = np.array([[1, 0], [0, 3], [1, 1], [2, 0]], "float32")   # logits 1, 3, 2, 2
    >>> np.asarray(cut_rank(h, table, [[3, 0]])).tolist()   # item 3 ties item 2, ranks third
    [3]
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    vocab_size = table.vocab_size
    ids = checks.int32_ids(item_ids, hidden, vocab_size, "item_ids")
    exclusions = _exclusions(exclude_ids, hidden, vocab_size)
    flat_hidden, flat_ids = _flatten(hidden, ids)
    keep = ops.logical_and(flat_ids >= 0, flat_ids < vocab_size)
    if exclusions is not None:
        excluded = ops.expand_dims(flat_ids, 2) == ops.expand_dims(exclusions, 1)  # [M, L, X]
        keep = ops.logical_and(keep, ops.logical_not(ops.any(excluded, axis=2)))
    logits = item_logits(flat_hidden, table.value, bias, flat_ids)
    score, first = first_item(logits, flat_ids, keep)
    above = dispatch("count_above", "chunked", flat_hidden, table, bias, score, first,
                     exclusions, chunk_size=chunk_size)
    above = ops.cast(above, "int32")
    ranks = ops.where(first < 0, 0, above + 1)
    ranks = ops.where(ops.logical_or(above < 0, ops.isnan(score)), -1, ranks)
    return ops.reshape(ranks, ops.shape(hidden)[:-1])


def cut_count_at_least(hidden, embeddings, threshold, bias=None, chunk_size=None):
    """Counts the items whose logit is `>= threshold`, per position, without logits.

    Args:
        hidden: float tensor `[..., D]`.
        embeddings: item table `[V, D]` (tensor, variable or Embedding layer;
            an `ItemEmbedding` with `use_bias=True` gives its bias too).
        threshold: float logit threshold.
        bias: optional float `[V]`, for a table without its own bias.
        chunk_size: vocabulary tile width; `None` uses the default rule.

    Returns:
        int32 counts of shape `hidden.shape[:-1]`; -1 for a position any of
        whose logits is NaN.

    Example:

    >>> import numpy as np
    >>> h = np.ones((2, 3), "float32")
    >>> table = np.array([[1, 1, 1], [-1, -1, -1], [1, 0, 0]], "float32")
    >>> np.asarray(cut_count_at_least(h, table, 0.5)).tolist()
    [2, 2]
    """
    hidden, table, bias, chunk_size = _prepare_retrieval(hidden, embeddings, bias, chunk_size)
    lead_shape = ops.shape(hidden)[:-1]
    flat_hidden, _ = _flatten(hidden)
    rows = ops.ones_like(flat_hidden[:, 0], dtype="float32")
    # At (threshold, V) every logit >= threshold ranks above: no item has id V.
    counts = dispatch(
        "count_above", "chunked", flat_hidden, table, bias, rows * float(threshold),
        ops.cast(rows, "int32") * table.vocab_size, None, chunk_size=chunk_size,
    )
    return ops.reshape(ops.cast(counts, "int32"), lead_shape)
