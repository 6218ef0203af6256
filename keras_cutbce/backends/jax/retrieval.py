"""Top-k retrieval and rank counts on jax, one `[M, T]` tile of logits at a time (the contract: the registry)."""

import functools

import jax
import jax.numpy as jnp

from keras_cutbce.backends.jax.chunked import tile_logits
from keras_cutbce.common import EMPTY_ID  # noqa: F401 - the id of empty slots, re-exported
from keras_cutbce.common import ids_as_int32


def _tiling(vocab_size, chunk_size):
    width = max(1, min(int(chunk_size), vocab_size))
    return width, -(-vocab_size // width)


def _tile(table, bias, index, width):
    vocab_size = table.shape[0]
    nominal = index * width
    start = jnp.minimum(nominal, vocab_size - width)
    rows = jax.lax.dynamic_slice_in_dim(table, start, width, axis=0)
    bias_tile = None
    if bias is not None:
        bias_tile = jax.lax.dynamic_slice_in_dim(bias, start, width, axis=0)
    columns = start + jnp.arange(width, dtype=jnp.int32)
    return columns, rows, bias_tile, columns >= nominal


def _excluded_mask(exclude_ids, start, width):
    local = exclude_ids.astype(jnp.int32) - start
    local = jnp.where((local >= 0) & (local < width), local, width)  # width: dropped
    rows = jnp.arange(exclude_ids.shape[0])[:, None]
    mask = jnp.zeros((exclude_ids.shape[0], width), dtype=bool)
    return mask.at[rows, local].set(True, mode="drop")


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, chunk_size):
    """The retrieval `top_k` (the contract: `keras_cutbce.registry`)."""
    if exclude_ids is not None:
        exclude_ids = ids_as_int32(exclude_ids, table.shape[0])
    return _top_k(hidden, table, k, bias, exclude_ids, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("k", "chunk_size"))
def _top_k(hidden, table, k, bias, exclude_ids, *, chunk_size):
    vocab_size = table.shape[0]
    rows = hidden.shape[0]
    width, num_tiles = _tiling(vocab_size, chunk_size)

    def body(index, carry):
        best_scores, best_ids, nan_rows = carry
        columns, table_tile, bias_tile, fresh = _tile(table, bias, index, width)
        z = tile_logits(hidden, table_tile, bias_tile)
        nan_rows = nan_rows | jnp.any(jnp.isnan(z), axis=1)
        drop = ~fresh[None, :]
        if exclude_ids is not None:
            drop = drop | _excluded_mask(exclude_ids, columns[0], width)
        z = jnp.where(drop, -jnp.inf, z)
        # Running entries come first and have lower ids than the tile's, and
        # lax.top_k puts the lower index first among equal values: ties go
        # to the lower id.
        scores = jnp.concatenate([best_scores, z], axis=1)
        ids = jnp.concatenate(
            [best_ids, jnp.broadcast_to(columns[None, :], (rows, width))], axis=1
        )
        best_scores, position = jax.lax.top_k(scores, k)
        return best_scores, jnp.take_along_axis(ids, position, axis=1), nan_rows

    init = (
        jnp.full((rows, k), -jnp.inf, jnp.float32),
        jnp.full((rows, k), EMPTY_ID, jnp.int32),
        jnp.zeros((rows,), bool),
    )
    with jax.named_scope("cut_top_k"):
        scores, ids, nan_rows = jax.lax.fori_loop(0, num_tiles, body, init)
    ids = jnp.where((scores == -jnp.inf) | nan_rows[:, None], EMPTY_ID, ids)
    return jnp.where(nan_rows[:, None], jnp.nan, scores), ids


def count_above(hidden, table, bias, scores, ids, exclude_ids=None, *, chunk_size):
    """The retrieval `count_above` (the contract: `keras_cutbce.registry`)."""
    if exclude_ids is not None:
        exclude_ids = ids_as_int32(exclude_ids, table.shape[0])
    counts, nan_rows = count_above_parts(
        hidden, table, bias, scores, ids, exclude_ids, chunk_size=chunk_size
    )
    return jnp.where(nan_rows, -1, counts)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def count_above_parts(hidden, table, bias, scores, ids, exclude_ids, *, chunk_size):
    """`count_above` as `(counts int32 [M], NaN rows bool [M])` for the sharded kernel; int32 exclusions."""
    width, num_tiles = _tiling(table.shape[0], chunk_size)
    scores = scores.astype(jnp.float32)[:, None]
    ids = ids.astype(jnp.int32)[:, None]

    def body(index, carry):
        counts, nan_rows = carry
        columns, table_tile, bias_tile, fresh = _tile(table, bias, index, width)
        z = tile_logits(hidden, table_tile, bias_tile)
        nan_rows = nan_rows | jnp.any(jnp.isnan(z), axis=1)
        columns = columns[None, :]
        above = (z > scores) | ((z == scores) & (columns < ids))
        above = above & fresh[None, :] & (columns != ids)
        if exclude_ids is not None:
            above = above & ~_excluded_mask(exclude_ids, columns[0, 0], width)
        return counts + jnp.sum(above, axis=1, dtype=jnp.int32), nan_rows

    init = (jnp.zeros((hidden.shape[0],), jnp.int32), jnp.zeros((hidden.shape[0],), bool))
    with jax.named_scope("cut_count_above"):
        return jax.lax.fori_loop(0, num_tiles, body, init)
