"""CutBCE on JAX: an XLA loop over vocabulary tiles under `jax.custom_vjp`.

The loss of one row is `(1 / V) * sum_v [scale_v softplus(z_v) - target_v z_v]`
with `z = h @ E.T + b` (see `DESIGN.md` and `keras_cutbce.coefficients`). It
is computed in two parts, so the `[M, V]` logits never exist:

- the dense background: every item with the negative weights
  `(neg_scale, neg_target)`, one vocabulary tile at a time in a `lax.scan`
  over the table reshaped to `[num_tiles, tile, D]` (plus one narrower tile
  for the remainder when `tile` does not divide `V`, so nothing is padded and
  nothing is masked);
- a sparse correction at the positives: the table rows of the valid,
  de-duplicated target ids are gathered, their logits computed and the
  weights `(delta_scale, delta_target)` added.

The backward pass (`jax.custom_vjp`) keeps only the inputs as residuals and
recomputes the logits tile by tile: with `dZ = g / V * (scale sigmoid(z) -
target)` it accumulates `grad_hidden += dZ @ E_tile` in the scan's carry and
emits `grad_table_tile = dZ.T @ h` and `grad_bias_tile = sum(dZ, 0)` as the
scan's stacked outputs (one matmul gives both), then scatter-adds the
positives' correction. Everything accumulates in
float32; gradients come back in each input's dtype. The code is
batch-polymorphic, so `jax.vmap` works over it.
"""

import functools

import jax
import jax.numpy as jnp

from keras_cutbce.coefficients import bce_coefficients
from keras_cutbce.tiling import default_chunk_size

_F32 = jnp.float32


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    z = jnp.matmul(hidden, table_tile.T, preferred_element_type=jnp.float32)
    if bias_tile is not None:
        z = z + bias_tile.astype(jnp.float32)
    return z


def _softplus(z):
    """Stable `log(1 + exp(z))`: one `exp` and one `log1p`, finite for any finite z."""
    return jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))


def _sigmoid(z):
    """Stable `1 / (1 + exp(-z))` from the same `exp(-|z|)`."""
    e = jnp.exp(-jnp.abs(z))
    return jnp.where(z >= 0, 1.0, e) / (1.0 + e)


def _bce_terms(z, scale, target):
    """`scale * softplus(z) - target * z`, skipping terms whose weight is 0."""
    out = _softplus(z) if scale == 1.0 else scale * _softplus(z)
    return out if target == 0.0 else out - target * z


def _bce_slopes(z, scale, target):
    """`d/dz` of `_bce_terms`: `scale * sigmoid(z) - target`."""
    out = _sigmoid(z) if scale == 1.0 else scale * _sigmoid(z)
    return out if target == 0.0 else out - target


# ----------------------------------------------------------------- tiling ---


def _split_tiles(table, bias, tile):
    """Splits the vocabulary into full tiles `[n, tile, ...]` and a remainder.

    Returns `((table_tiles, bias_tiles), (table_rest, bias_rest))`; the
    remainder is `None` when `tile` divides `V`, bias parts are `None`
    without bias.
    """
    vocab, dim = table.shape
    num_tiles = vocab // tile
    cut = num_tiles * tile
    tiles = (
        table[:cut].reshape(num_tiles, tile, dim),
        None if bias is None else bias[:cut].reshape(num_tiles, tile),
    )
    rest = None
    if cut < vocab:
        rest = (table[cut:], None if bias is None else bias[cut:])
    return tiles, rest


def _dense_loss_sum(hidden, table, bias, tile, coef):
    """`sum_v [neg_scale softplus(z_v) - neg_target z_v]` per row, `[M]` float32."""

    def tile_sum(table_tile, bias_tile):
        z = tile_logits(hidden, table_tile, bias_tile)
        return jnp.sum(_bce_terms(z, coef.neg_scale, coef.neg_target), axis=1)

    def step(total, xs):
        return total + tile_sum(*xs), None

    tiles, rest = _split_tiles(table, bias, tile)
    total, _ = jax.lax.scan(step, jnp.zeros(hidden.shape[:1], _F32), tiles)
    if rest is not None:
        total = total + tile_sum(*rest)
    return total


def _dense_grads(hidden, table, bias, tile, coef, row_scale):
    """Gradients of `sum_m row_scale_m * dense_sum_m` for hidden, table, bias (float32).

    Per tile, `dZ` is read by two matmuls only: `dZ @ E_tile` for hidden and
    `[h, 1].T @ dZ` (`[D + 1, tile]`) for the table and, in its last row, the
    bias. Both are plain (untransposed) matmuls for XLA's CPU backend; the
    stacked `[D + 1, V]` result is transposed once at the end.
    """
    hidden_t = hidden.astype(_F32).T  # [D, M]
    if bias is not None:
        hidden_t = jnp.concatenate([hidden_t, jnp.ones_like(hidden_t[:1])], axis=0)

    def tile_grads(table_tile, bias_tile):
        z = tile_logits(hidden, table_tile, bias_tile)
        dz = row_scale[:, None] * _bce_slopes(z, coef.neg_scale, coef.neg_target)
        return jnp.matmul(dz, table_tile.astype(_F32)), jnp.matmul(hidden_t, dz)

    def step(grad_hidden, xs):
        tile_hidden, tile_table_t = tile_grads(*xs)
        return grad_hidden + tile_hidden, tile_table_t

    tiles, rest = _split_tiles(table, bias, tile)
    init = jnp.zeros(hidden.shape, _F32)
    grad_hidden, stacked = jax.lax.scan(step, init, tiles)  # [n, D(+1), tile]
    grad_table_t = jnp.moveaxis(stacked, 1, 0).reshape(stacked.shape[1], -1)
    if rest is not None:
        rest_hidden, rest_table_t = tile_grads(*rest)
        grad_hidden = grad_hidden + rest_hidden
        grad_table_t = jnp.concatenate([grad_table_t, rest_table_t], axis=1)
    dim = table.shape[1]
    grad_bias = None if bias is None else grad_table_t[dim]
    return grad_hidden, grad_table_t[:dim].T, grad_bias


# -------------------------------------------------------------- positives ---


def _positives(ids, vocab_size):
    """Gather indices `[M, L]` int32 and the 0/1 weight of each (valid, first occurrence)."""
    wide = jnp.int64 if ids.dtype.itemsize == 8 else jnp.int32
    ids = ids.astype(wide)
    valid = (ids >= 0) & (ids < vocab_size)
    key = jnp.where(valid, ids, -1)
    length = ids.shape[-1]
    earlier = jnp.tril(jnp.ones((length, length), bool), -1)  # [j, k]: k < j
    repeated = jnp.any((key[:, :, None] == key[:, None, :]) & earlier, axis=-1)
    keep = valid & ~repeated
    index = jnp.where(keep, ids, 0).astype(jnp.int32)
    return index, keep


def _positive_logits(hidden, table, bias, index):
    """Float32 logits `[M, L]` at the gathered rows, and the rows `[M, L, D]`."""
    rows = jnp.take(table, index, axis=0)
    z = jnp.sum(hidden.astype(_F32)[:, None, :] * rows.astype(_F32), axis=-1)
    if bias is not None:
        z = z + jnp.take(bias, index, axis=0).astype(_F32)
    return z, rows


# ------------------------------------------------------------- custom_vjp ---


def _loss(hidden, table, ids, bias, coef, tile):
    vocab = table.shape[0]
    total = _dense_loss_sum(hidden, table, bias, tile, coef)
    if ids.shape[-1] > 0:
        index, keep = _positives(ids, vocab)
        z, _ = _positive_logits(hidden, table, bias, index)
        terms = _bce_terms(z, coef.delta_scale, coef.delta_target)
        total = total + jnp.sum(jnp.where(keep, terms, 0.0), axis=-1)
    return total / vocab


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cut_bce(hidden, table, ids, bias, coef, tile):
    return _loss(hidden, table, ids, bias, coef, tile)


def _cut_bce_fwd(hidden, table, ids, bias, coef, tile):
    return _loss(hidden, table, ids, bias, coef, tile), (hidden, table, ids, bias)


def _cut_bce_bwd(coef, tile, residuals, g):
    hidden, table, ids, bias = residuals
    vocab = table.shape[0]
    row_scale = g.astype(_F32) / vocab
    grad_hidden, grad_table, grad_bias = _dense_grads(
        hidden, table, bias, tile, coef, row_scale
    )
    if ids.shape[-1] > 0:
        index, keep = _positives(ids, vocab)
        z, rows = _positive_logits(hidden, table, bias, index)
        slopes = _bce_slopes(z, coef.delta_scale, coef.delta_target)
        dz = jnp.where(keep, row_scale[:, None] * slopes, 0.0)
        grad_hidden = grad_hidden + jnp.sum(dz[..., None] * rows.astype(_F32), axis=1)
        drop = jnp.where(keep, index, vocab)  # out of range: dropped by the scatter
        updates = dz[..., None] * hidden.astype(_F32)[:, None, :]
        grad_table = grad_table.at[drop].add(updates, mode="drop")
        if bias is not None:
            grad_bias = grad_bias.at[drop].add(dz, mode="drop")
    return (
        grad_hidden.astype(hidden.dtype),
        grad_table.astype(table.dtype),
        None,
        None if bias is None else grad_bias.astype(bias.dtype),
    )


_cut_bce.defvjp(_cut_bce_fwd, _cut_bce_bwd)

# Compiled as one XLA program even when called eagerly; a no-op inside `jit`.
_cut_bce_jit = jax.jit(_cut_bce, static_argnums=(4, 5))


def cut_bce(
    hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size=None
):
    """Per-row full-vocabulary binary cross-entropy, tile by tile, with exact gradients.

    Args:
        hidden: float `[M, D]` (float32, bfloat16 or float16).
        table: float `[V, D]`.
        ids: integer `[M, L]` target ids (`L` may be 0); ids outside `[0, V)`
            are padding, a repeated id in a row counts once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width (a positive int); `None` uses
            `keras_cutbce.tiling.default_chunk_size`.

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
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    ids = jnp.asarray(ids)
    bias = None if bias is None else jnp.asarray(bias)
    vocab = table.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], vocab)
    tile = max(1, min(int(chunk_size), vocab))
    coef = bce_coefficients(label_smoothing, pos_weight)
    return _cut_bce_jit(hidden, table, ids, bias, coef, tile)
