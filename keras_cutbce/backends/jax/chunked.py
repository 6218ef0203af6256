"""CutBCE on JAX: an XLA loop over vocabulary tiles under `jax.custom_vjp`.

The loss of one row is `(1 / V) * sum_v [scale_v softplus(z_v) - target_v z_v]`
with `z = h @ E.T + b` (`keras_cutbce.math.coefficients`). It is computed in
two parts, so the `[M, V]` logits never exist:

- the negatives: every item with the negative weights, one vocabulary tile
  at a time in a `lax.scan` over tile indices (each tile a `dynamic_slice`
  of the table, plus one narrower tile for the remainder when `tile` does
  not divide `V`: the table is never copied, padded or masked per logit),
  with the row's positives set to `-inf` in each tile's logits by one
  O(M L) scatter of their ids (`mask_positives`), so their dense terms are
  exactly 0;
- the positives (`keras_cutbce.math.positives.distinct_targets`): their
  table rows are gathered and their exact terms added. Nothing is added
  and subtracted back, so a saturated positive keeps full float32
  precision whatever V.

The loss is the one varying piece: the loop is given a loss family
(`math.BCE`, `math.Softmax`; the seam: docs/development.md), which turns each tile's
logits into its part of the rows' reduction and its slopes, and the
positives' logits into their terms. What is the loop's own: a `lax.scan`
with the rows' reduction, the hidden gradient and the table and bias
gradients in its carry (the table gradient written tile by tile in place
into its `[V, D]` buffer), the positives' gather and scatter-add, and the
`custom_vjp` (`keras_cutbce.backends.jax.vjp`).

`cut_bce` (per-row loss) keeps only the inputs as residuals; its backward
pass recomputes the logits tile by tile. `cut_bce_weighted_sum` (a scalar,
the training path of a reduced loss) computes the loss and the gradients at
cotangent 1 in one scan, and its backward pass only scales them. Both run
the same per-tile function (`_tile_pass`), as do `cut_softmax` and its
weighted sum. Float32 accumulation; `cut_bce` is batch-polymorphic (`vmap`).
"""

import functools

import jax
import jax.numpy as jnp

from keras_cutbce.backends.jax import math, vjp
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import default_chunk_size
from keras_cutbce.math.tiling import tile_budget_bytes

_F32 = jnp.float32


def tile_budget():
    """Returns the `keras_cutbce.math.tiling` budget for JAX on its default platform."""
    return tile_budget_bytes("jax", jax.default_backend())


def tile_logits(hidden, table_tile, bias_tile=None):
    """Returns the float32 logits `[M, tile]` of one vocabulary tile."""
    z = jnp.matmul(hidden, table_tile.T, preferred_element_type=jnp.float32)
    if bias_tile is not None:
        z = z + bias_tile.astype(jnp.float32)
    return z


def mask_positives(z, ids, start):
    """Returns the tile's logits `z` `[M, tile]` with `-inf` at the row's positives: O(M L).

    The tile covers the items `[start, start + tile)`. One scatter of the
    `[M, L]` ids (duplicates set the same place twice; padding and ids of
    other tiles are dropped), never a per-logit compare. At `-inf` the
    negatives' `softplus` and `sigmoid` are exactly 0 (`exp(-|z|)` is 0), so
    the dense pass adds nothing for a positive (no add-and-subtract of a
    saturated `softplus(z) ~ z`); only the linear `neg_target * z` of label
    smoothing needs `_drop_masked`.

    Example:

    >>> import numpy as np
    >>> z = jnp.zeros((2, 4))
    >>> np.asarray(mask_positives(z, jnp.array([[5, 5], [-1, 9]]), 4)).tolist()
    [[0.0, -inf, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    rows, tile = z.shape
    if ids.shape[-1] == 0:
        return z
    local = ids - start
    column = jnp.where((local >= 0) & (local < tile), local, tile)  # tile: dropped
    row = jax.lax.broadcasted_iota(column.dtype, column.shape, 0)
    return z.at[row, column].set(-jnp.inf, mode="drop")


# ----------------------------------------------------------------- tiling ---


def _tile_at(table, bias, start, size):
    """Returns the items `[start, start + size)` of the table and bias: slices, never copies."""
    table_tile = jax.lax.dynamic_slice_in_dim(table, start, size, axis=0)
    bias_tile = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
    return table_tile, bias_tile


def _tile_pass(hidden, hidden_t, table_tile, bias_tile, ids, start, family, stats, *, loss,
               row_scale):
    """Computes one vocabulary tile: the logits, then what the loss family makes of them.

    Computes the tile's logits `z` (one matmul; a family that `masks_positives`
    gets the row's positives at `-inf`, `mask_positives`, O(M L)), then
    `family.tile`: the tile's part of the rows' reduction if `loss` (else
    `None`), and, with `row_scale` (`[M]` float32), the slopes `S`, scaled
    per row to `dZ`, for the tile's part of the hidden gradient `dZ @ E_tile`
    (`[M, D]`) and `hidden_t @ dZ` (`[D (+1), tile]`: the table gradient,
    transposed, and in its last row the bias gradient when `hidden_t`
    carries a row of ones), else `None, None`. `dZ` is read by two plain
    (untransposed) matmuls only, for XLA's CPU backend.
    """
    z = tile_logits(hidden, table_tile, bias_tile)
    if family.masks_positives:
        z = mask_positives(z, ids, start)
    part, slopes = family.tile(z, stats, loss=loss, grad=row_scale is not None)
    if row_scale is None:
        return part, None, None
    dz = row_scale[:, None] * slopes
    return part, jnp.matmul(dz, table_tile.astype(_F32)), jnp.matmul(hidden_t, dz)


def _dense_pass(hidden, table, bias, ids, tile, family, stats=None, *, loss, row_scale=None):
    """Runs every tile in one `lax.scan` over tile indices.

    Returns `(acc, grads)`: `acc` is the family's reduction of the rows over
    all tiles (`family.init`, `family.merge`; BCE: the per-row sum of the
    negatives' terms) when `loss`, else `None`; `grads` is `None` without
    `row_scale`, else the float32 gradients `(hidden, table, bias or None)`
    of the dense terms weighted by `row_scale`. `stats`: the row statistics
    of a first pass (a `two_pass` family), passed to every tile.
    The rows' reduction, the hidden gradient and the table and bias
    gradients (updated in place, tile by tile) ride in the scan's carry. Tiles are
    sliced out of the table inside the loop (`dynamic_slice`), plus one
    narrower tile for the remainder when `tile` does not divide `V`: the
    table is never copied, padded or masked.
    """
    want_grads = row_scale is not None
    hidden_t = None
    if want_grads:
        hidden_t = hidden.astype(_F32).T  # [D, M]
        if bias is not None:
            hidden_t = jnp.concatenate([hidden_t, jnp.ones_like(hidden_t[:1])], axis=0)

    def tile_pass(start, size):
        table_tile, bias_tile = _tile_at(table, bias, start, size)
        return _tile_pass(
            hidden, hidden_t, table_tile, bias_tile, ids, start, family, stats,
            loss=loss, row_scale=row_scale,
        )

    def add(a, b):
        return None if a is None else a + b

    def merge(a, b):
        return None if a is None else family.merge(a, b)

    dim = table.shape[1]

    def accumulate(carry, start, size):
        loss_rows, grad_hidden, grad_table, grad_bias = carry
        tile_loss, tile_hidden, tile_table_t = tile_pass(start, size)
        if want_grads:
            # A [D (+1), tile] block, transposed in place into the [V, D] gradient.
            grad_table = jax.lax.dynamic_update_slice_in_dim(
                grad_table, tile_table_t[:dim].T, start, axis=0
            )
            if bias is not None:
                grad_bias = jax.lax.dynamic_update_slice_in_dim(
                    grad_bias, tile_table_t[dim], start, axis=0
                )
        return merge(loss_rows, tile_loss), add(grad_hidden, tile_hidden), grad_table, grad_bias

    rows = hidden.shape[0]
    vocab = table.shape[0]
    num_tiles, rest = divmod(vocab, tile)
    carry = (
        family.init(rows) if loss else None,
        jnp.zeros(hidden.shape, _F32) if want_grads else None,
        # The table and bias gradients, written tile by tile in place: no
        # stacked tiles, no concatenation, no transposed copy.
        jnp.zeros((vocab, dim), _F32) if want_grads else None,
        jnp.zeros((vocab,), _F32) if want_grads and bias is not None else None,
    )
    carry, _ = jax.lax.scan(
        lambda carry, index: (accumulate(carry, index * tile, tile), None),
        carry,
        jnp.arange(num_tiles, dtype=jnp.int32),
    )
    if rest:
        carry = accumulate(carry, num_tiles * tile, rest)
    loss_rows, grad_hidden, grad_table, grad_bias = carry
    if not want_grads:
        return loss_rows, None
    return loss_rows, (grad_hidden, grad_table, grad_bias)


# -------------------------------------------------------------- positives ---


def _positive_logits(hidden, table, bias, index):
    """Returns the float32 logits `[M, L]` at the gathered rows, and the rows `[M, L, D]`."""
    rows = jnp.take(table, index, axis=0)
    z = jnp.sum(hidden.astype(_F32)[:, None, :] * rows.astype(_F32), axis=-1)
    if bias is not None:
        z = z + jnp.take(bias, index, axis=0).astype(_F32)
    return z, rows


def _add_positives(hidden, table, bias, index, keep, family, grads, *, loss, row_scale=None):
    """Adds the positives' terms (`family.positives`) to a dense pass.

    Returns `(positive_rows, grads)`: each row's sum of its valid positives'
    terms (`[M]`) when `loss`, else `None`; `grads` (`(hidden, table, bias or
    None)` float32, or `None`) with the gradient of
    `sum_m row_scale_m * positive_rows_m` added.
    """
    if index.shape[-1] == 0:
        return None, grads
    vocab = table.shape[0]
    z, rows = _positive_logits(hidden, table, bias, index)
    terms, slopes = family.positives(z, keep, loss=loss, grad=grads is not None)
    positive_rows = None if terms is None else jnp.sum(jnp.where(keep, terms, 0.0), axis=-1)
    if grads is not None:
        grad_hidden, grad_table, grad_bias = grads
        dz = jnp.where(keep, row_scale[:, None] * slopes, 0.0)
        grad_hidden = grad_hidden + jnp.sum(dz[..., None] * rows.astype(_F32), axis=1)
        drop = jnp.where(keep, index, vocab)  # out of range: dropped by the scatter
        updates = dz[..., None] * hidden.astype(_F32)[:, None, :]
        grad_table = grad_table.at[drop].add(updates, mode="drop")
        if bias is not None:
            grad_bias = grad_bias.at[drop].add(dz, mode="drop")
        grads = (grad_hidden, grad_table, grad_bias)
    return positive_rows, grads


def _loss_and_grads(hidden, table, ids, bias, family, tile, *, loss, row_weights=None):
    """Returns the per-row loss `[M]` (or `None`) and the float32 gradients (or `None`).

    The gradients are those of `sum_m row_weights_m * loss_m`; the family
    turns the weights into the rows' slope factors (`family.row_scale`). A
    `two_pass` family's gradients run a first pass for the row statistics
    (`family.statistics`), whose reduction also gives the loss.
    """
    vocab = table.shape[0]
    index, keep = distinct_targets(ids, vocab)
    row_scale = None if row_weights is None else family.row_scale(row_weights, keep, vocab)
    acc = stats = None
    if family.two_pass and row_scale is not None:
        acc, _ = _dense_pass(hidden, table, bias, ids, tile, family, loss=True)
        stats = family.statistics(acc)
    dense, grads = _dense_pass(
        hidden, table, bias, ids, tile, family, stats, loss=loss and acc is None,
        row_scale=row_scale,
    )
    acc = dense if acc is None else acc
    positive_rows, grads = _add_positives(
        hidden, table, bias, index, keep, family, grads, loss=loss, row_scale=row_scale
    )
    return (family.finish(acc, positive_rows, keep, vocab) if loss else None), grads


@functools.lru_cache(maxsize=128)
def _functions(family, tile):
    """Returns the jitted `(per_row_loss, weighted_sum)` of one configuration (`vjp`'s builders)."""

    def loss_fn(hidden, table, ids, bias):
        return _loss_and_grads(hidden, table, ids, bias, family, tile, loss=True)[0]

    def grads_fn(hidden, table, ids, bias, row_weights):
        return _loss_and_grads(
            hidden, table, ids, bias, family, tile, loss=False, row_weights=row_weights
        )[1]

    def loss_and_grads_fn(hidden, table, ids, bias, row_weights):
        return _loss_and_grads(
            hidden, table, ids, bias, family, tile, loss=True, row_weights=row_weights
        )

    # Compiled as one XLA program even when called eagerly; a no-op inside `jit`.
    return (jax.jit(vjp.per_row_loss(loss_fn, grads_fn)),
            jax.jit(vjp.weighted_sum(loss_fn, loss_and_grads_fn)))


def _prepare(hidden, table, ids, bias, chunk_size):
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    ids = jnp.asarray(ids)
    bias = None if bias is None else jnp.asarray(bias)
    vocab = table.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], vocab, tile_budget())
    tile = max(1, min(int(chunk_size), vocab))
    return hidden, table, ids, bias, tile


def cut_bce(
    hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size=None
):
    """Computes the per-row full-vocabulary binary cross-entropy tile by tile, with exact gradients.

    Args:
        hidden: float `[M, D]` (float32, bfloat16 or float16).
        table: float `[V, D]`.
        ids: integer `[M, L]` target ids (`L` may be 0); ids outside `[0, V)`
            are padding, a repeated id in a row counts once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width (a positive int); `None` uses
            `keras_cutbce.math.tiling.default_chunk_size`.

    Returns:
        Float32 `[M]`: `(1/V) sum_v [scale_v softplus(z_v) - target_v z_v]`.
        Differentiable (any cotangent) w.r.t. `hidden`, `table` and `bias`,
        under `jit`, `grad` and `vmap`.

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(3, 8)).astype("float32")
    >>> table = np.random.normal(size=(100, 8)).astype("float32")
    >>> cut_bce(h, table, np.array([[1, 2], [3, -1], [5, 5]]), chunk_size=32).shape
    (3,)
    """
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _functions(family, tile)[0](hidden, table, ids, bias)


def cut_bce_weighted_sum(
    hidden,
    table,
    ids,
    bias,
    row_weights,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
):
    """Computes `sum_m row_weights[m] * cut_bce(...)[m]` and its gradients in one pass.

    The fused training path of a reduced loss (`keras_cutbce.ops.weighted_loss_sum`).
    The output is a scalar, so the gradient for an upstream cotangent `c` is
    `c` times the gradient at `c = 1`: when a gradient is asked for, one
    `lax.scan` over the vocabulary tiles computes the loss and the three
    gradients together (per tile one logits matmul, one `exp(-|z|)` shared
    by softplus and sigmoid, and the two gradient matmuls; nothing is
    recomputed in the backward pass, which only scales the saved gradients by
    `c`). Plain evaluation computes the loss alone.

    Args:
        hidden: float `[M, D]` (float32, bfloat16 or float16).
        table: float `[V, D]`.
        ids: integer `[M, L]` target ids (`L` may be 0); ids outside `[0, V)`
            are padding, a repeated id in a row counts once.
        bias: optional float `[V]` (or `None`).
        row_weights: float `[M]` per-row weights; constants (their gradient is 0).
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width (a positive int); `None` uses
            `keras_cutbce.math.tiling.default_chunk_size`.

    Returns:
        A float32 scalar, differentiable w.r.t. `hidden`, `table` and `bias`
        under `jit`, `grad` and `value_and_grad` (gradients in each input's dtype).

    Example:

    >>> import numpy as np
    >>> h = np.random.normal(size=(3, 8)).astype("float32")
    >>> table = np.random.normal(size=(100, 8)).astype("float32")
    >>> ids = np.array([[1, 2], [3, -1], [5, 5]])
    >>> w = np.array([1.0, 0.0, 0.5], "float32")
    >>> total = cut_bce_weighted_sum(h, table, ids, None, w, chunk_size=32)
    >>> bool(np.isclose(total, np.sum(w * cut_bce(h, table, ids, chunk_size=32)), rtol=1e-5))
    True
    """
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    row_weights = jnp.asarray(row_weights, _F32).reshape(hidden.shape[:1])
    return _functions(family, tile)[1](hidden, table, ids, bias, row_weights)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None):
    """`cut_bce` for the softmax cross-entropy (`math.Softmax`; no `pos_weight`), float32 `[M]`."""
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return _functions(family, tile)[0](hidden, table, ids, bias)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing=0.0,
                             chunk_size=None):
    """`cut_bce_weighted_sum` for the softmax cross-entropy (`math.Softmax`)."""
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.Softmax(float(label_smoothing), table.shape[0])
    row_weights = jnp.asarray(row_weights, _F32).reshape(hidden.shape[:1])
    return _functions(family, tile)[1](hidden, table, ids, bias, row_weights)
