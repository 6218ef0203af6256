"""Public CutBCE ops: argument checks, flattening and one dispatch table.

Every implementation module defines the same small interface on 2-D inputs
(ids already int32, out-of-range ids already `EMPTY_ID`):

- `cut_bce(hidden [M, D], table [V, D], ids [M, L], bias [V] | None,
  *, label_smoothing, pos_weight, chunk_size) -> loss [M] float32`
- `cut_bce_weighted_sum(hidden, table, ids, bias, row_weights [M], *,
  label_smoothing, pos_weight, chunk_size) -> scalar` (optional: a fused
  loss-and-gradient pass; without it the per-row loss is reduced)
- `top_k(hidden, table, k, bias, exclude_ids [M, X] | None, *, chunk_size)
  -> (scores [M, k] float32, ids [M, k] int32)`
- `count_at_least(hidden, table, bias, threshold, *, chunk_size) -> [M]
  int32`, the number of logits `>= threshold` per row.

`_MODULES` below says which module implements which op for each
implementation; the vocabulary-sharded one (`"sharded"`, JAX only) takes an
extra `sharding=` keyword and is used whenever the table is split along V
over a JAX mesh (`keras_cutbce.backends.jax.sharded`), read from the table's
variable, so a traced value inside a compiled step is routed too.

Argument checks live in `keras_cutbce.validation` and run before any
kernel; `chunk_size=None` resolves with `tiling.default_chunk_size` for the
chunked kernels (Pallas and the sharded path choose their own tiles).
"""

import importlib
import math
from typing import NamedTuple

import keras
from keras import ops

from keras_cutbce import validation
from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.tiling import default_chunk_size
from keras_cutbce.math.tiling import tile_budget_bytes

IMPLEMENTATIONS = validation.IMPLEMENTATIONS

# (op, implementation) -> module defining `op`; "{backend}" is the Keras backend.
_MODULES = {
    ("cut_bce", "reference"): "keras_cutbce.math.reference",
    ("cut_bce", "chunked"): "keras_cutbce.backends.{backend}.chunked",
    ("cut_bce", "pallas"): "keras_cutbce.backends.jax.pallas",
    ("cut_bce", "sharded"): "keras_cutbce.backends.jax.sharded",
    ("cut_bce_weighted_sum", "chunked"): "keras_cutbce.backends.{backend}.chunked",
    ("cut_bce_weighted_sum", "pallas"): "keras_cutbce.backends.jax.pallas",
    ("cut_bce_weighted_sum", "sharded"): "keras_cutbce.backends.jax.sharded",
    ("top_k", "chunked"): "keras_cutbce.backends.{backend}.retrieval",
    ("top_k", "sharded"): "keras_cutbce.backends.jax.sharded",
    ("count_at_least", "chunked"): "keras_cutbce.backends.{backend}.retrieval",
    ("count_at_least", "sharded"): "keras_cutbce.backends.jax.sharded",
}


class ItemTable(NamedTuple):
    """A resolved item table: its current value and its vocabulary sharding (or None)."""

    value: object
    sharding: object


def _vocab_sharding(*candidates):
    """The `VocabSharding` of the first candidate split along V over a JAX mesh."""
    if keras.backend.backend() != "jax":
        return None
    from keras_cutbce.backends.jax import sharded

    for candidate in candidates:
        if candidate is not None:
            found = sharded.vocab_sharding_of(candidate)
            if found is not None:
                return found
    return None


def resolve_table(source, argument="embeddings", value=None):
    """An `ItemTable` for a table given as a tensor, variable, layer (or `ItemTable`).

    The sharding is read from the variable behind `source` when there is one
    (its layout), else from the value. `value`, when given, is the value to
    use instead of reading `source` (e.g. the traced state of a JAX step).
    """
    if isinstance(source, ItemTable):
        return source
    variable = validation.table_variable(source, argument)
    if value is None:
        value = validation.read_table(source, argument)
    value = ops.convert_to_tensor(value)
    stored = variable if isinstance(variable, keras.Variable) else None
    return ItemTable(value, _vocab_sharding(stored, value))


def resolve_embeddings(embeddings, argument="embeddings"):
    """The current value of an item table given as a tensor, variable or layer."""
    return resolve_table(embeddings, argument).value


def _platform(tensor):
    """"cpu", "gpu", "tpu", ... where the active backend runs `tensor`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "torch":
        return "gpu" if tensor.device.type == "cuda" else tensor.device.type
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _default_chunk_size(hidden, table):
    lead = validation.static_dims(hidden)[:-1]
    rows = None if None in lead else int(math.prod(lead))
    budget = tile_budget_bytes(keras.backend.backend(), _platform(hidden))
    return default_chunk_size(rows or 4096, validation.static_dims(table)[0] or 2**20, budget)


def _jax_target_platform():
    """The platform a JAX program is compiled for, or None: decided at lowering."""
    from keras_cutbce.backends.jax import tpu_target

    return tpu_target.target_platform()


def select_implementation(implementation="auto"):
    """Returns the implementation `"auto"` resolves to on this backend and target.

    On JAX, `"pallas"` when the program is compiled for a TPU (known at trace
    time: a TPU host, a TPU mesh or `jax.default_device`), else `"chunked"`.
    When the target is only known at lowering (a CPU host with the TPU
    compiler), the ops compile both and keep the target's
    (`keras_cutbce.backends.jax.tpu_target`); this function then answers for
    the host.
    """
    validation.check_implementation(implementation)
    if implementation != "auto":
        return implementation
    if keras.backend.backend() == "jax" and _jax_target_platform() == "tpu":
        return "pallas"
    return "chunked"


def _by_target_auto(op, implementation):
    """Whether `op` under `implementation` is decided at lowering (JAX, `auto`, TPU unknown)."""
    return (
        implementation == "auto"
        and keras.backend.backend() == "jax"
        and _MODULES.get((op, "pallas")) is not None
        and _jax_target_platform() is None
    )


def _route(op, implementation, sharding):
    """The implementation that runs `op`: sharded tables first, then the chosen one."""
    if sharding is not None and implementation in ("auto", "chunked"):
        return "sharded"
    return select_implementation(implementation)


def _kernel(op, implementation):
    """The function implementing `op` for `implementation`, or None (optional ops)."""
    backend = keras.backend.backend()
    if backend not in ("jax", "torch", "tensorflow"):
        raise NotImplementedError(f"CutBCE has no kernel for the {backend!r} backend.")
    path = _MODULES.get((op, implementation))
    if path is None:
        return None
    return getattr(importlib.import_module(path.format(backend=backend)), op, None)


def _dispatch(op, implementation, hidden, table, *args, chunk_size, **kwargs):
    """Runs `op` on 2-D inputs with the implementation `_route` picks.

    Returns None when the routed implementation lacks an optional op.
    """
    if table.sharding is None and _by_target_auto(op, implementation):
        from keras_cutbce.backends.jax import tpu_target

        def run(route):
            return lambda h, t, *a: _dispatch(op, route, h, ItemTable(t, None), *a,
                                               chunk_size=chunk_size, **kwargs)

        return tpu_target.by_target((hidden, table.value) + args, run("pallas"), run("chunked"))
    route = _route(op, implementation, table.sharding)
    kernel = _kernel(op, route)
    if kernel is None:
        return None
    if route == "reference":
        return kernel(hidden, table.value, *args, **kwargs)
    if route == "sharded":
        kwargs["sharding"] = table.sharding
        if op == "cut_bce" and implementation == "chunked":
            kwargs["kernel"] = "chunked"  # forced: the XLA loop on every shard, TPU included
    elif route == "chunked" and chunk_size is None:
        chunk_size = _default_chunk_size(hidden, table.value)
    return kernel(hidden, table.value, *args, chunk_size=chunk_size, **kwargs)


def _flatten(hidden, ids=None):
    d = ops.shape(hidden)[-1]
    flat_hidden = ops.reshape(hidden, (-1, d))
    if ids is None:
        return flat_hidden, None
    return flat_hidden, ops.reshape(ids, (ops.shape(flat_hidden)[0], ops.shape(ids)[-1]))


def _tensor(x):
    return ops.convert_to_tensor(x)


class _LossArgs(NamedTuple):
    """Checked, flattened arguments of the loss ops."""

    hidden: object
    table: ItemTable
    ids: object
    bias: object
    lead_shape: tuple
    chunk_size: object
    implementation: str
    label_smoothing: float
    pos_weight: float


def _prepare_loss(hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
                  chunk_size, implementation):
    """Checks every argument (before any kernel runs) and flattens to 2-D."""
    implementation = validation.check_implementation(implementation)
    chunk_size = validation.check_chunk_size(chunk_size)
    label_smoothing = validation.check_label_smoothing(label_smoothing)
    pos_weight = validation.check_pos_weight(pos_weight)
    hidden = _tensor(hidden)
    table = resolve_table(embeddings)
    if implementation not in ("auto", "chunked"):
        table = ItemTable(table.value, None)
    bias = None if bias is None else resolve_embeddings(bias, "bias")
    validation.check_hidden_and_table(hidden, table.value, bias)
    ids = validation.checked_ids(
        target_ids, hidden, validation.vocab_size_of(table.value), "target_ids"
    )
    flat_hidden, flat_ids = _flatten(hidden, ids)
    return _LossArgs(
        flat_hidden, table, flat_ids, bias, ops.shape(hidden)[:-1], chunk_size,
        implementation, label_smoothing, pos_weight,
    )


def _per_row_loss(p):
    """Flat float32 `[M]` loss of prepared arguments."""
    loss = _dispatch(
        "cut_bce", p.implementation, p.hidden, p.table, p.ids, p.bias,
        chunk_size=p.chunk_size, label_smoothing=p.label_smoothing,
        pos_weight=p.pos_weight,
    )
    return ops.cast(loss, "float32")


def cut_binary_crossentropy(
    hidden,
    embeddings,
    target_ids,
    bias=None,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    implementation="auto",
):
    """Per-position binary cross-entropy over the full vocabulary, without logits.

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
            (`keras.layers.Embedding`, LoRA-enabled too).
        target_ids: integer ids `[..., L]` (or `[...]` for one id a position),
            of any integer dtype. Ids outside `[0, V)` are padding (int64 ids
            beyond the int32 range too); duplicates count once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: finite float > 0 weighting the positive terms.
        chunk_size: vocabulary tile width (an int, NumPy ints accepted);
            `None` uses `keras_cutbce.math.tiling.default_chunk_size`.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX only) or
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
    p = _prepare_loss(
        hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
        chunk_size, implementation,
    )
    return ops.reshape(_per_row_loss(p), p.lead_shape)


def weighted_loss_sum(
    hidden,
    embeddings,
    target_ids,
    row_weights,
    bias=None,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    implementation="auto",
):
    """`sum(row_weights * cut_binary_crossentropy(...))`: the scalar a reduced loss needs.

    `CutBCELoss` reduces per-position losses with known weights (sample
    weights, masks, the reduction's divisor), so only this scalar is
    differentiated, and the gradient for any upstream cotangent `c` is `c`
    times the gradient at `c = 1`. Implementations with a fused kernel
    (`cut_bce_weighted_sum`) compute that gradient in the same pass over the
    vocabulary as the loss (one logits matmul and one `exp` per logit instead
    of two); the others reduce `cut_binary_crossentropy`. `row_weights`
    (shape `hidden.shape[:-1]`) are constants: no gradient.

    Example:

    >>> import numpy as np
    >>> h = np.ones((2, 4), "float32"); table = np.ones((10, 4), "float32")
    >>> ids = np.array([[1], [2]])
    >>> round(float(weighted_loss_sum(h, table, ids, np.array([0.5, 0.5]))), 3)
    3.618
    """
    p = _prepare_loss(
        hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
        chunk_size, implementation,
    )
    weights = ops.reshape(
        ops.stop_gradient(ops.cast(row_weights, "float32")), (ops.shape(p.hidden)[0],)
    )
    total = _dispatch(
        "cut_bce_weighted_sum", p.implementation, p.hidden, p.table, p.ids, p.bias,
        weights, chunk_size=p.chunk_size, label_smoothing=p.label_smoothing,
        pos_weight=p.pos_weight,
    )
    if total is None:  # no fused kernel on this implementation
        return ops.sum(weights * _per_row_loss(p))
    return ops.cast(total, "float32")


def _prepare_retrieval(hidden, embeddings, bias, chunk_size):
    chunk_size = validation.check_chunk_size(chunk_size)
    hidden = _tensor(hidden)
    table = resolve_table(embeddings)
    bias = None if bias is None else resolve_embeddings(bias, "bias")
    validation.check_hidden_and_table(hidden, table.value, bias)
    return hidden, table, bias, chunk_size


def cut_top_k(hidden, embeddings, k, bias=None, exclude_ids=None, chunk_size=None):
    """Top-k items per position without the `[positions, V]` logits.

    Keeps a running top-k merged tile by tile over the vocabulary, so memory
    is O(positions x (k + tile)). Exact against a dense `top_k` of
    `hidden @ E.T + bias`, ties broken by the lower id. A position whose
    hidden state holds a NaN gets NaN scores and ids `EMPTY_ID` (-1), on
    every backend.

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (tensor, variable or Embedding layer).
        k: number of items to return, an int in `[1, V]` (NumPy ints too).
        bias: optional float `[V]`.
        exclude_ids: optional integer ids `[..., X]` never returned for that
            position (e.g. items already seen); ids outside `[0, V)` (int64
            ids beyond the int32 range too) are ignored.
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
    k = validation.check_k(k, validation.static_dims(table.value)[0])
    if exclude_ids is not None:
        exclude_ids = validation.checked_ids(
            exclude_ids, hidden, validation.vocab_size_of(table.value), "exclude_ids"
        )
    lead_shape = tuple(ops.shape(hidden)[:-1])
    flat_hidden, flat_exclude = _flatten(hidden, exclude_ids)
    scores, ids = _dispatch(
        "top_k", "chunked", flat_hidden, table, k, bias, flat_exclude, chunk_size=chunk_size
    )
    scores, ids = ops.cast(scores, "float32"), ops.cast(ids, "int32")
    # One NaN rule on every backend: a NaN hidden state has no ranking.
    nan_rows = ops.expand_dims(ops.any(ops.isnan(flat_hidden), axis=-1), -1)
    scores = ops.where(nan_rows, ops.full_like(scores, float("nan")), scores)
    ids = ops.where(nan_rows, ops.full_like(ids, EMPTY_ID), ids)
    return ops.reshape(scores, lead_shape + (k,)), ops.reshape(ids, lead_shape + (k,))


def cut_count_at_least(hidden, embeddings, threshold, bias=None, chunk_size=None):
    """Number of items whose logit is `>= threshold`, per position, without logits.

    Args:
        hidden: float tensor `[..., D]`.
        embeddings: item table `[V, D]` (tensor, variable or Embedding layer).
        threshold: float logit threshold.
        bias: optional float `[V]`.
        chunk_size: vocabulary tile width; `None` uses the default rule.

    Returns:
        int32 counts of shape `hidden.shape[:-1]`.

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
    counts = _dispatch(
        "count_at_least", "chunked", flat_hidden, table, bias, float(threshold),
        chunk_size=chunk_size,
    )
    return ops.reshape(ops.cast(counts, "int32"), lead_shape)
