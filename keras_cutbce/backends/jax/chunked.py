"""The chunked implementation on JAX: a `lax.scan` over vocabulary tiles under `vjp.py`'s `custom_vjp`.

The tiles are `dynamic_slice`s of the table (never copied, padded or
masked per logit); the carry holds the rows' reduction and the gradients.
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
_HIGHEST = jax.lax.Precision.HIGHEST


def tile_budget():
    """The `keras_cutbce.math.tiling` budget for JAX on its default platform."""
    return tile_budget_bytes("jax", jax.default_backend())


def tile_logits(hidden, table_tile, bias_tile=None):
    """The float32 logits `[M, tile]` of one vocabulary tile."""
    z = jnp.matmul(hidden, table_tile.T, preferred_element_type=jnp.float32)
    if bias_tile is not None:
        z = z + bias_tile.astype(jnp.float32)
    return z


def mask_positives(z, ids, start):
    """`z` `[M, tile]` with `-inf` at the row's positives in `[start, start + tile)`: one O(M L) scatter."""
    rows, tile = z.shape
    if ids.shape[-1] == 0:
        return z
    local = ids - start
    column = jnp.where((local >= 0) & (local < tile), local, tile)  # tile: dropped
    row = jax.lax.broadcasted_iota(column.dtype, column.shape, 0)
    return z.at[row, column].set(-jnp.inf, mode="drop")


# ----------------------------------------------------------------- tiling ---


def _tile_at(table, bias, start, size):
    table_tile = jax.lax.dynamic_slice_in_dim(table, start, size, axis=0)
    bias_tile = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
    return table_tile, bias_tile


def _tile_pass(hidden, hidden_t, table_tile, bias_tile, ids, start, family, stats, *, loss,
               row_scale):
    """One tile: `(row part | None, dZ @ E_tile | None, hidden_t @ dZ | None)` (the table's gradient transposed)."""
    z = tile_logits(hidden, table_tile, bias_tile)
    if family.masks_positives:
        z = mask_positives(z, ids, start)
    part, slopes = family.tile(z, stats, loss=loss, grad=row_scale is not None)
    if row_scale is None:
        return part, None, None
    dz = row_scale[:, None] * slopes
    return part, jnp.matmul(dz, table_tile.astype(_F32)), jnp.matmul(hidden_t, dz)


def dense_pass(hidden, table, bias, ids, tile, family, stats=None, *, loss, row_scale=None):
    """One pass over the tiles: `(acc | None, (grad_hidden, grad_table, grad_bias) | None)` of the tiles' part.

    `ids`: the positives a masking family sets to `-inf`; `row_scale`: the slopes' factor (the
    gradients'), `stats` a two-pass family's `statistics`. The sharded path runs it per shard.
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
    rows = jnp.take(table, index, axis=0)
    z = jnp.sum(hidden.astype(_F32)[:, None, :] * rows.astype(_F32), axis=-1)
    if bias is not None:
        z = z + jnp.take(bias, index, axis=0).astype(_F32)
    return z, rows


def _add_positives(hidden, table, bias, index, keep, family, grads, *, loss, row_scale, counted):
    if index.shape[-1] == 0:
        return None, grads
    vocab = table.shape[0]
    z, rows = _positive_logits(hidden, table, bias, index)
    terms, slopes = family.positives(z, counted, loss=loss, grad=grads is not None)
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


def _add_linear(hidden, table, bias, family, grads, *, loss, row_scale=None):
    """`-linear * sum_v z_v` a row in closed form (`h . sum_v E_v + sum_v b_v`) and its gradients."""
    table_sum = jnp.sum(table.astype(_F32), axis=0)
    rows = None
    if loss:
        rows = -family.linear * jnp.matmul(hidden.astype(_F32), table_sum, precision=_HIGHEST)
        rows = rows if bias is None else rows - family.linear * jnp.sum(bias.astype(_F32))
    if grads is not None:
        const = -family.linear * row_scale
        grad_hidden, grad_table, grad_bias = grads
        grad_hidden = grad_hidden + const[:, None] * table_sum
        grad_table = grad_table + jnp.matmul(const, hidden.astype(_F32), precision=_HIGHEST)[None, :]
        grad_bias = None if grad_bias is None else grad_bias + jnp.sum(const)
        grads = (grad_hidden, grad_table, grad_bias)
    return rows, grads


def sparse_terms(hidden, table, bias, index, keep, family, grads, *, loss, row_scale=None,
                 counted=None):
    """The positives' (rows of `index` where `keep`) and `linear` background's row sums and `grads` plus theirs.

    The row sums are None without id slots; `counted`: the mask `family.positives`
    weighs by (default `keep`; the sharded path: every shard's positives).
    """
    positive_rows, grads = _add_positives(
        hidden, table, bias, index, keep, family, grads, loss=loss, row_scale=row_scale,
        counted=keep if counted is None else counted,
    )
    if family.linear:
        rows, grads = _add_linear(hidden, table, bias, family, grads, loss=loss, row_scale=row_scale)
        positive_rows = rows if positive_rows is None or rows is None else positive_rows + rows
    return positive_rows, grads


def _loss_and_grads(hidden, table, ids, bias, family, tile, *, loss, row_weights=None):
    vocab = table.shape[0]
    index, keep = distinct_targets(ids, vocab)
    row_scale = positive_scale = None
    if row_weights is not None:
        row_scale, positive_scale = family.row_scale(row_weights, keep, vocab)
    acc = stats = None
    if family.two_pass and row_scale is not None:
        acc, _ = dense_pass(hidden, table, bias, ids, tile, family, loss=True)
        stats = family.statistics(acc)
    dense, grads = dense_pass(
        hidden, table, bias, ids, tile, family, stats, loss=loss and acc is None,
        row_scale=row_scale,
    )
    acc = dense if acc is None else acc
    positive_rows, grads = sparse_terms(
        hidden, table, bias, index, keep, family, grads, loss=loss, row_scale=positive_scale
    )
    return (family.finish(acc, positive_rows, keep, vocab) if loss else None), grads


@functools.lru_cache(maxsize=128)
def _functions(family, tile):

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
    """The chunked `cut_bce` (the contract: `keras_cutbce.registry`); `chunk_size=None`: the default tile."""
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
    """The chunked `cut_bce_weighted_sum`: one scan for the loss and the gradients at cotangent 1."""
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    row_weights = jnp.asarray(row_weights, _F32).reshape(hidden.shape[:1])
    return _functions(family, tile)[1](hidden, table, ids, bias, row_weights)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None):
    """The chunked `cut_softmax` (`math.Softmax`)."""
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return _functions(family, tile)[0](hidden, table, ids, bias)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing=0.0,
                             chunk_size=None):
    """The chunked `cut_softmax_weighted_sum`."""
    hidden, table, ids, bias, tile = _prepare(hidden, table, ids, bias, chunk_size)
    family = math.Softmax(float(label_smoothing), table.shape[0])
    row_weights = jnp.asarray(row_weights, _F32).reshape(hidden.shape[:1])
    return _functions(family, tile)[1](hidden, table, ids, bias, row_weights)
