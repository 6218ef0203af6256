"""Public CutBCE ops: argument checks, flattening and dispatch to a backend.

Every backend implements the same small interface on 2-D inputs, in
`keras_cutbce/backends/<backend>/`:

- `chunked.cut_bce(hidden [M, D], table [V, D], ids [M, L] int, bias [V] | None,
  *, label_smoothing, pos_weight, chunk_size) -> loss [M] float32`
- `retrieval.top_k(hidden, table, k, bias, exclude_ids [M, X] | None,
  chunk_size) -> (scores [M, k] float32, ids [M, k] int32)`
- `retrieval.count_at_least(hidden, table, bias, threshold, chunk_size)
  -> [M] int32`, the number of logits `>= threshold` per row.

This module checks arguments once (before any kernel runs), flattens the
leading dimensions, resolves `chunk_size=None` with `tiling.default_chunk_size`
and picks the implementation.
"""

import importlib
import math
from typing import NamedTuple

import keras
from keras import ops

from keras_cutbce import reference
from keras_cutbce.tiling import default_chunk_size
from keras_cutbce.tiling import tile_budget_bytes

IMPLEMENTATIONS = ("auto", "chunked", "pallas", "reference")


def resolve_embeddings(embeddings, argument="embeddings"):
    """Returns the current value of an item table given as a tensor, variable or layer.

    A `keras.Variable` is read now, so inside a train step (JAX stateless
    steps included) the value is the one being differentiated.
    """
    if isinstance(embeddings, keras.layers.Layer):
        variable = getattr(embeddings, "embeddings", None)
        if variable is None:
            raise TypeError(
                f"`{argument}` must be a [V, D] tensor, a keras.Variable or a layer "
                "with an `embeddings` variable (e.g. keras.layers.Embedding); "
                f"received layer {embeddings.name!r} of type "
                f"{type(embeddings).__name__} without one (is it built?)."
            )
        embeddings = variable
    return ops.convert_to_tensor(embeddings)


def _raw_shape(x):
    shape = getattr(x, "shape", None)
    return tuple(ops.shape(x)) if shape is None else tuple(shape)


def _dims(x):
    """Static dimensions of `x`, None where unknown."""
    out = []
    for d in _raw_shape(x):
        try:
            out.append(None if d is None else int(d))
        except TypeError:
            out.append(None)
    return tuple(out)


def _is_float(x):
    return "float" in str(keras.backend.standardize_dtype(x.dtype))


def _is_int(x):
    return "int" in str(keras.backend.standardize_dtype(x.dtype))


def _check_hidden_and_table(hidden, table, bias):
    h_dims, t_dims = _dims(hidden), _dims(table)
    if len(h_dims) < 2:
        raise ValueError(
            "`hidden` must have rank >= 2, shape [..., D]; "
            f"received shape {h_dims}."
        )
    if not _is_float(hidden):
        raise TypeError(
            f"`hidden` must be a float tensor; received dtype {hidden.dtype}."
        )
    if len(t_dims) != 2:
        raise ValueError(
            f"`embeddings` must have shape [V, D]; received shape {t_dims}."
        )
    if not _is_float(table):
        raise TypeError(
            f"`embeddings` must be a float table; received dtype {table.dtype}."
        )
    if None not in (h_dims[-1], t_dims[1]) and h_dims[-1] != t_dims[1]:
        raise ValueError(
            "`hidden` and `embeddings` must share the last dimension D: expected "
            f"hidden [..., {t_dims[1]}] for embeddings {t_dims}; received hidden "
            f"shape {h_dims}."
        )
    if bias is not None:
        b_dims = _dims(bias)
        if len(b_dims) != 1 or (None not in (b_dims[0], t_dims[0]) and b_dims[0] != t_dims[0]):
            raise ValueError(
                f"`bias` must have shape [V] = [{t_dims[0]}] to match `embeddings` "
                f"{t_dims}; received shape {b_dims}."
            )
        if not _is_float(bias):
            raise TypeError(f"`bias` must be float; received dtype {bias.dtype}.")


def _check_ids(ids, hidden, argument):
    if not _is_int(ids):
        raise TypeError(
            f"`{argument}` must be an integer tensor of item ids (ids outside "
            f"[0, V) are padding); received dtype {ids.dtype}. Float ids are "
            "exact only below 2**24: keep them integral."
        )
    h_dims, i_dims = _dims(hidden), _dims(ids)
    lead = h_dims[:-1]
    if len(i_dims) == len(lead):  # one id per position
        ids = ops.expand_dims(ids, -1)
        i_dims = i_dims + (1,)
    if len(i_dims) != len(lead) + 1 or any(
        a is not None and b is not None and a != b for a, b in zip(i_dims[:-1], lead)
    ):
        raise ValueError(
            f"`{argument}` must have shape [..., L] with the leading dimensions of "
            f"`hidden` {h_dims}, i.e. {lead + ('L',)}; received shape {i_dims}."
        )
    return ids


def _check_implementation(implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"`implementation` must be one of {IMPLEMENTATIONS}; received "
            f"{implementation!r}."
        )
    if implementation == "pallas" and keras.backend.backend() != "jax":
        raise ValueError(
            "`implementation='pallas'` needs the JAX backend; the Keras backend is "
            f"{keras.backend.backend()!r}."
        )


def _check_chunk_size(chunk_size):
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
    ):
        raise ValueError(
            f"`chunk_size` must be None or a positive int; received {chunk_size!r}."
        )


def _num_rows(dims):
    lead = dims[:-1]
    return None if None in lead else int(math.prod(lead))


def _flatten(hidden, ids):
    d = ops.shape(hidden)[-1]
    flat_hidden = ops.reshape(hidden, (-1, d))
    flat_ids = None
    if ids is not None:
        flat_ids = ops.reshape(ids, (ops.shape(flat_hidden)[0], ops.shape(ids)[-1]))
    return flat_hidden, flat_ids


def _on_tpu():
    import jax

    return jax.devices()[0].platform == "tpu"


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
    rows = _num_rows(_dims(hidden))
    budget = tile_budget_bytes(keras.backend.backend(), _platform(hidden))
    return default_chunk_size(rows or 4096, _dims(table)[0] or 2**20, budget)


def _backend_module(name):
    """`keras_cutbce.backends.<backend>.<name>` for the active Keras backend."""
    backend = keras.backend.backend()
    if backend not in ("jax", "torch", "tensorflow"):
        raise NotImplementedError(f"CutBCE has no kernel for the {backend!r} backend.")
    return importlib.import_module(f"keras_cutbce.backends.{backend}.{name}")


def _chunked_module():
    return _backend_module("chunked")


def _retrieval_module():
    return _backend_module("retrieval")


def _vocab_sharding(embeddings):
    """The `VocabSharding` of a table split along V over a JAX mesh, else None.

    Only on the JAX backend; see `keras_cutbce.backends.jax.sharded`.
    """
    if keras.backend.backend() != "jax":
        return None
    from keras_cutbce.backends.jax import sharded

    return sharded.vocab_sharding_of(embeddings)


def select_implementation(implementation="auto"):
    """Returns the implementation `"auto"` resolves to on this backend and device."""
    _check_implementation(implementation)
    if implementation != "auto":
        return implementation
    if keras.backend.backend() == "jax" and _on_tpu():
        return "pallas"
    return "chunked"


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
        embeddings: item table `[V, D]`: a tensor, a `keras.Variable`, or a
            layer with an `embeddings` variable (`keras.layers.Embedding`).
        target_ids: integer ids `[..., L]` (or `[...]` for one id a position).
            Ids outside `[0, V)` are padding; duplicates count once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width; `None` uses
            `keras_cutbce.tiling.default_chunk_size`.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX only) or
            `"reference"` (dense, for tests and debugging). With `"auto"` or
            `"chunked"` on JAX, a table split along V over a mesh runs the
            vocab-sharded kernel (`keras_cutbce.backends.jax.sharded`).

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(2, 3, 8)).astype("float32")
    >>> table = np.random.normal(size=(100, 8)).astype("float32")
    >>> ids = np.array([[[1, 2], [3, -1], [5, 5]]] * 2)
    >>> cut_binary_crossentropy(h, table, ids).shape
    (2, 3)
    """
    prepared = _prepare(
        hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
        chunk_size, implementation,
    )
    return ops.reshape(_per_row_loss(prepared), prepared.lead_shape)


class _Prepared(NamedTuple):
    """Checked, flattened arguments of the loss ops."""

    hidden: object
    table: object
    ids: object
    bias: object
    lead_shape: tuple
    chunk_size: int
    user_chunk_size: object
    implementation: str
    sharding: object
    label_smoothing: float
    pos_weight: float


def _prepare(hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
             chunk_size, implementation):
    """Checks every argument (before any kernel runs) and flattens to 2-D."""
    _check_implementation(implementation)
    _check_chunk_size(chunk_size)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(
            f"`label_smoothing` must be in [0, 1]; received {label_smoothing!r}."
        )
    if not float(pos_weight) > 0.0:
        raise ValueError(f"`pos_weight` must be > 0; received {pos_weight!r}.")
    hidden = ops.convert_to_tensor(hidden)
    sharding = None
    if implementation in ("auto", "chunked"):
        sharding = _vocab_sharding(embeddings)
    table = resolve_embeddings(embeddings)
    bias = None if bias is None else resolve_embeddings(bias, "bias")
    target_ids = ops.convert_to_tensor(target_ids)
    _check_hidden_and_table(hidden, table, bias)
    target_ids = _check_ids(target_ids, hidden, "target_ids")
    flat_hidden, flat_ids = _flatten(hidden, target_ids)
    user_chunk_size = chunk_size
    if chunk_size is None:
        chunk_size = _default_chunk_size(hidden, table)
    return _Prepared(
        flat_hidden, table, flat_ids, bias, ops.shape(hidden)[:-1], chunk_size,
        user_chunk_size, select_implementation(implementation), sharding,
        float(label_smoothing), float(pos_weight),
    )


def _per_row_loss(p):
    """Flat `[M]` loss of prepared arguments, on the selected implementation."""
    kwargs = dict(label_smoothing=p.label_smoothing, pos_weight=p.pos_weight)
    if p.sharding is not None:  # table split along V over a JAX mesh
        from keras_cutbce.backends.jax import sharded

        return sharded.cut_bce(
            p.hidden, p.table, p.ids, p.bias, sharding=p.sharding,
            chunk_size=p.user_chunk_size, **kwargs
        )
    if p.implementation == "reference":
        return reference.cut_bce(p.hidden, p.table, p.ids, p.bias, **kwargs)
    if p.implementation == "pallas":
        from keras_cutbce.backends.jax import pallas_tpu

        # The Pallas kernels pick MXU-aligned tiles from the chip's VMEM themselves.
        return pallas_tpu.cut_bce(
            p.hidden, p.table, p.ids, p.bias, chunk_size=p.user_chunk_size, **kwargs
        )
    return _chunked_module().cut_bce(
        p.hidden, p.table, p.ids, p.bias, chunk_size=p.chunk_size, **kwargs
    )


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
    times the gradient at `c = 1`. Backends with a fused kernel
    (`chunked.cut_bce_weighted_sum`) compute that gradient in the same pass
    over the vocabulary as the loss (one logits matmul and one `exp` per
    logit instead of two); the others reduce `cut_binary_crossentropy`.
    `row_weights` (shape `hidden.shape[:-1]`) are constants: no gradient.

    Example:

    >>> import numpy as np
    >>> h = np.ones((2, 4), "float32"); table = np.ones((10, 4), "float32")
    >>> ids = np.array([[1], [2]])
    >>> round(float(weighted_loss_sum(h, table, ids, np.array([0.5, 0.5]))), 3)
    3.618
    """
    p = _prepare(
        hidden, embeddings, target_ids, bias, label_smoothing, pos_weight,
        chunk_size, implementation,
    )
    weights = ops.reshape(
        ops.stop_gradient(ops.cast(row_weights, "float32")), (ops.shape(p.hidden)[0],)
    )
    fused = None
    if p.implementation == "chunked" and p.sharding is None:
        fused = getattr(_chunked_module(), "cut_bce_weighted_sum", None)
    if fused is None:
        return ops.sum(weights * ops.cast(_per_row_loss(p), "float32"))
    return fused(
        p.hidden, p.table, p.ids, p.bias, weights, chunk_size=p.chunk_size,
        label_smoothing=p.label_smoothing, pos_weight=p.pos_weight,
    )


def cut_top_k(hidden, embeddings, k, bias=None, exclude_ids=None, chunk_size=None):
    """Top-k items per position without the `[positions, V]` logits.

    Keeps a running top-k merged tile by tile over the vocabulary, so memory
    is O(positions x (k + tile)). Exact against a dense `top_k` of
    `hidden @ E.T + bias`, ties broken by the lower id.

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]` (tensor, variable or Embedding layer).
        k: number of items to return, `1 <= k <= V`.
        bias: optional float `[V]`.
        exclude_ids: optional integer ids `[..., X]` never returned for that
            position (e.g. items already seen); ids outside `[0, V)` ignored.
        chunk_size: vocabulary tile width; `None` uses the default rule.

    Returns:
        `(scores, ids)`: float32 `[..., k]` logits sorted descending and int32
        `[..., k]` item ids.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(4, 8)).astype("float32")
    >>> table = np.random.normal(size=(50, 8)).astype("float32")
    >>> scores, ids = cut_top_k(h, table, k=5)
    >>> tuple(ids.shape)
    (4, 5)
    """
    _check_chunk_size(chunk_size)
    hidden = ops.convert_to_tensor(hidden)
    sharding = _vocab_sharding(embeddings)
    table = resolve_embeddings(embeddings)
    bias = None if bias is None else resolve_embeddings(bias, "bias")
    _check_hidden_and_table(hidden, table, bias)
    vocab_size = _dims(table)[0]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (
        vocab_size is not None and k > vocab_size
    ):
        raise ValueError(
            f"`k` must be an int in [1, V] = [1, {vocab_size}]; received {k!r}."
        )
    if exclude_ids is not None:
        exclude_ids = _check_ids(ops.convert_to_tensor(exclude_ids), hidden, "exclude_ids")
    lead_shape = tuple(ops.shape(hidden)[:-1])
    flat_hidden, flat_exclude = _flatten(hidden, exclude_ids)
    if sharding is not None:  # table split along V over a JAX mesh
        from keras_cutbce.backends.jax import sharded

        scores, ids = sharded.top_k(
            flat_hidden, table, k, bias, flat_exclude, sharding=sharding,
            chunk_size=chunk_size,
        )
        return ops.reshape(scores, lead_shape + (k,)), ops.reshape(ids, lead_shape + (k,))
    if chunk_size is None:
        chunk_size = _default_chunk_size(hidden, table)
    scores, ids = _retrieval_module().top_k(
        flat_hidden, table, k, bias, flat_exclude, chunk_size=chunk_size
    )
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
    """
    _check_chunk_size(chunk_size)
    hidden = ops.convert_to_tensor(hidden)
    table = resolve_embeddings(embeddings)
    bias = None if bias is None else resolve_embeddings(bias, "bias")
    _check_hidden_and_table(hidden, table, bias)
    lead_shape = ops.shape(hidden)[:-1]
    flat_hidden, _ = _flatten(hidden, None)
    if chunk_size is None:
        chunk_size = _default_chunk_size(hidden, table)
    counts = _retrieval_module().count_at_least(
        flat_hidden, table, bias, float(threshold), chunk_size=chunk_size
    )
    return ops.reshape(counts, lead_shape)
