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

The per-logit terms and slopes are `keras_cutbce.backends.jax.math`'s (the
functions the Pallas kernel calls); the `custom_vjp` is
`keras_cutbce.backends.jax.vjp`'s. What is this kernel's own: the loop (a
`lax.scan` with the per-row loss, the hidden gradient and the table and
bias gradients in its carry, the table gradient written tile by tile in
place into its `[V, D]` buffer) and the positives' gather and scatter-add.

`cut_bce` (per-row loss) keeps only the inputs as residuals; its backward
pass recomputes the logits tile by tile. `cut_bce_weighted_sum` (a scalar,
the training path of a reduced loss) computes the loss and the gradients at
cotangent 1 in one scan, and its backward pass only scales them. Both run
the same per-tile function (`_tile_pass`). Everything accumulates in
float32; gradients come back in each input's dtype. `cut_bce` is
batch-polymorphic, so `jax.vmap` works over it.
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


def _drop_masked(values, z, coef):
    """Returns `values` with 0 where `mask_positives` put `-inf` (only label smoothing needs it)."""
    if coef.neg_target == 0.0:
        return values
    return jnp.where(z == -jnp.inf, 0.0, values)


# ----------------------------------------------------------------- tiling ---


def _tile_at(table, bias, start, size):
    """Returns the items `[start, start + size)` of the table and bias: slices, never copies."""
    table_tile = jax.lax.dynamic_slice_in_dim(table, start, size, axis=0)
    bias_tile = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
    return table_tile, bias_tile


def _tile_pass(hidden, hidden_t, table_tile, bias_tile, ids, start, coef, *, loss, row_scale):
    """Computes one vocabulary tile's negatives: the per-tile math, written once.

    Computes the tile's logits `z` (one matmul), sets the row's positives to
    `-inf` (`mask_positives`, O(M L)), so their terms are exactly 0 here (the
    positives' pass adds them exactly), and `e = exp(-|z|)` once, shared by
    softplus and sigmoid. Then what is asked for:

    - `loss=True`: the per-row sum of `neg_scale softplus(z) - neg_target z`
      over the tile's negatives (`[M]` float32), else `None`;
    - `row_scale` (`[M]` float32) given: with
      `dZ = row_scale[:, None] * (neg_scale sigmoid(z) - neg_target)` (0 at
      the positives), the tile's part of the hidden gradient `dZ @ E_tile`
      (`[M, D]`) and `hidden_t @ dZ` (`[D (+1), tile]`: the table gradient,
      transposed, and in its last row the bias gradient when `hidden_t`
      carries a row of ones), else `None, None`.

    Per logit: one exp, one log1p (loss), one reciprocal (gradient) and a
    few selects; per tile, `dZ` is read by two matmuls only, both plain
    (untransposed) for XLA's CPU backend.
    """
    z = mask_positives(tile_logits(hidden, table_tile, bias_tile), ids, start)
    e = math.exp_neg_abs(z)
    loss_rows = None
    if loss:
        terms = _drop_masked(math.terms(z, e, coef), z, coef)
        loss_rows = jnp.sum(terms, axis=1)
    if row_scale is None:
        return loss_rows, None, None
    slopes = _drop_masked(math.slopes(z, e, coef), z, coef)
    dz = row_scale[:, None] * slopes
    return loss_rows, jnp.matmul(dz, table_tile.astype(_F32)), jnp.matmul(hidden_t, dz)


def _dense_pass(hidden, table, bias, ids, tile, coef, *, loss, row_scale=None):
    """Sums the negatives of every tile in one `lax.scan` over tile indices.

    Returns `(loss_rows, grads)`: `loss_rows` is the per-row
    `sum_v [neg_scale softplus(z_v) - neg_target z_v]` over the row's
    negatives (`[M]` float32) when `loss`, else `None`; `grads` is `None`
    without `row_scale`, else the float32 gradients
    `(hidden, table, bias or None)` of `sum_m row_scale_m * loss_rows_m`.
    The per-row loss sum, the hidden gradient and the table and bias
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
            hidden, hidden_t, table_tile, bias_tile, ids, start, coef,
            loss=loss, row_scale=row_scale,
        )

    def add(a, b):
        return None if a is None else a + b

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
        return add(loss_rows, tile_loss), add(grad_hidden, tile_hidden), grad_table, grad_bias

    rows = hidden.shape[0]
    vocab = table.shape[0]
    num_tiles, rest = divmod(vocab, tile)
    carry = (
        jnp.zeros((rows,), _F32) if loss else None,
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


def _add_positives(hidden, table, bias, ids, coef, loss_rows, grads, row_scale=None):
    """Adds the positives' exact terms to a dense pass over the negatives.

    `loss_rows` (`[M]`, or `None`) gets each row's
    `sum_p pos_minus softplus(-z_p) + pos_plus softplus(z_p)`; `grads`
    (`(hidden, table, bias or None)` float32, or `None`) get the gradient of
    `sum_m row_scale_m * positives_m`. Returns the updated `(loss_rows, grads)`.
    """
    if ids.shape[-1] == 0:
        return loss_rows, grads
    vocab = table.shape[0]
    index, keep = distinct_targets(ids, vocab)
    z, rows = _positive_logits(hidden, table, bias, index)
    e = math.exp_neg_abs(z)
    if loss_rows is not None:
        terms = math.terms(z, e, coef, positive=True)
        loss_rows = loss_rows + jnp.sum(jnp.where(keep, terms, 0.0), axis=-1)
    if grads is not None:
        grad_hidden, grad_table, grad_bias = grads
        dz = jnp.where(keep, row_scale[:, None] * math.slopes(z, e, coef, positive=True), 0.0)
        grad_hidden = grad_hidden + jnp.sum(dz[..., None] * rows.astype(_F32), axis=1)
        drop = jnp.where(keep, index, vocab)  # out of range: dropped by the scatter
        updates = dz[..., None] * hidden.astype(_F32)[:, None, :]
        grad_table = grad_table.at[drop].add(updates, mode="drop")
        if bias is not None:
            grad_bias = grad_bias.at[drop].add(dz, mode="drop")
        grads = (grad_hidden, grad_table, grad_bias)
    return loss_rows, grads


def _loss_and_grads(hidden, table, ids, bias, coef, tile, *, loss, row_scale=None):
    """Returns the per-row loss `[M]` (or `None`) and the float32 gradients (or `None`).

    The gradients are those of `sum_m row_scale_m * V * loss_m`, i.e. of
    `sum_m row_scale_m * (dense + positives)_m`: `row_scale` already holds
    the `1 / V`.
    """
    loss_rows, grads = _dense_pass(
        hidden, table, bias, ids, tile, coef, loss=loss, row_scale=row_scale
    )
    loss_rows, grads = _add_positives(hidden, table, bias, ids, coef, loss_rows, grads, row_scale)
    if loss_rows is not None:
        loss_rows = loss_rows / table.shape[0]
    return loss_rows, grads


@functools.lru_cache(maxsize=128)
def _functions(coef, tile):
    """Returns the jitted `(per_row_loss, weighted_sum)` of one configuration (`vjp`'s builders)."""

    def loss_fn(hidden, table, ids, bias):
        return _loss_and_grads(hidden, table, ids, bias, coef, tile, loss=True)[0]

    def grads_fn(hidden, table, ids, bias, row_scale):
        row_scale = row_scale / table.shape[0]
        return _loss_and_grads(
            hidden, table, ids, bias, coef, tile, loss=False, row_scale=row_scale
        )[1]

    def loss_and_grads_fn(hidden, table, ids, bias, row_weights):
        row_scale = row_weights / table.shape[0]
        return _loss_and_grads(hidden, table, ids, bias, coef, tile, loss=True, row_scale=row_scale)

    # Compiled as one XLA program even when called eagerly; a no-op inside `jit`.
    return (jax.jit(vjp.per_row_loss(loss_fn, grads_fn)),
            jax.jit(vjp.weighted_sum(loss_fn, loss_and_grads_fn)))


def _prepare(hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size):
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    ids = jnp.asarray(ids)
    bias = None if bias is None else jnp.asarray(bias)
    vocab = table.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], vocab, tile_budget())
    tile = max(1, min(int(chunk_size), vocab))
    coef = bce_coefficients(label_smoothing, pos_weight)
    return hidden, table, ids, bias, coef, tile


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
    hidden, table, ids, bias, coef, tile = _prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size
    )
    return _functions(coef, tile)[0](hidden, table, ids, bias)


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
    hidden, table, ids, bias, coef, tile = _prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size
    )
    row_weights = jnp.asarray(row_weights, _F32).reshape(hidden.shape[:1])
    return _functions(coef, tile)[1](hidden, table, ids, bias, row_weights)
