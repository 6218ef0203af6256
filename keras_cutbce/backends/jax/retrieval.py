"""Top-k retrieval and threshold counts on JAX, tile by tile over the vocabulary.

Both functions loop over vocabulary tiles with `lax.fori_loop` and only ever
hold one `[M, T]` tile of logits (from `chunked.tile_logits`, the one fused
tile function) plus the running result, so their memory is O(M * (k + T))
whatever V is. They are `jax.jit`-ed (k and the tile static), so eager calls
reuse the compiled loop, and they nest in any outer `jit`.

Tiles all have the same static width `T = min(chunk_size, V)`. The last tile
starts at `V - T` instead of running past the table (no padded copy of the
table); its columns that the previous tile already covered are masked out.
"""

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
    """Returns the start, rows `[tile, D]`, bias `[tile]` and fresh-column mask of tile `index`."""
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
    """Returns bool `[M, tile]`: True where the row excludes the tile's column."""
    local = exclude_ids.astype(jnp.int32) - start
    local = jnp.where((local >= 0) & (local < width), local, width)  # width: dropped
    rows = jnp.arange(exclude_ids.shape[0])[:, None]
    mask = jnp.zeros((exclude_ids.shape[0], width), dtype=bool)
    return mask.at[rows, local].set(True, mode="drop")


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, chunk_size):
    """Returns the exact top-k logits per row without the `[M, V]` logits.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        k: int in `[1, V]`.
        bias: optional float `[V]`.
        exclude_ids: optional int `[M, X]`: ids never returned for that row;
            ids outside `[0, V)` are ignored (int64 ids are checked before
            any int32 cast, so `2**32 + 16` never excludes item 16).
        chunk_size: vocabulary tile width.

    Returns:
        `(scores, ids)`: float32 `[M, k]` logits sorted descending (ties:
        lower id first, as a stable sort of `-logits`) and int32 `[M, k]`
        ids. Slots no item can fill (fewer than k items left after the
        exclusions) have score `-inf` and id `EMPTY_ID` (-1).

    Example:

    >>> import numpy as np
    >>> h = np.ones((1, 2), "float32")
    >>> table = np.array([[1, 0], [0, 3], [1, 1]], "float32")
    >>> scores, ids = top_k(h, table, 2, chunk_size=2)
    >>> ids.tolist(), scores.tolist()
    ([[1, 2]], [[3.0, 2.0]])
    """
    if exclude_ids is not None:
        exclude_ids = ids_as_int32(exclude_ids, table.shape[0])
    return _top_k(hidden, table, k, bias, exclude_ids, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("k", "chunk_size"))
def _top_k(hidden, table, k, bias, exclude_ids, *, chunk_size):
    vocab_size = table.shape[0]
    rows = hidden.shape[0]
    width, num_tiles = _tiling(vocab_size, chunk_size)

    def body(index, carry):
        best_scores, best_ids = carry
        columns, table_tile, bias_tile, fresh = _tile(table, bias, index, width)
        z = tile_logits(hidden, table_tile, bias_tile)
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
        return best_scores, jnp.take_along_axis(ids, position, axis=1)

    init = (
        jnp.full((rows, k), -jnp.inf, jnp.float32),
        jnp.full((rows, k), EMPTY_ID, jnp.int32),
    )
    with jax.named_scope("cut_top_k"):
        scores, ids = jax.lax.fori_loop(0, num_tiles, body, init)
    return scores, jnp.where(scores == -jnp.inf, EMPTY_ID, ids)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def count_at_least(hidden, table, bias, threshold, *, chunk_size):
    """Returns int32 `[M]`: how many of each row's V logits are `>= threshold`.

    Example:

    >>> import numpy as np
    >>> h = np.ones((1, 2), "float32")
    >>> table = np.array([[1, 0], [0, 3], [1, 1]], "float32")
    >>> count_at_least(h, table, None, 2.0, chunk_size=2).tolist()
    [2]
    """
    width, num_tiles = _tiling(table.shape[0], chunk_size)

    def body(index, counts):
        _, table_tile, bias_tile, fresh = _tile(table, bias, index, width)
        z = tile_logits(hidden, table_tile, bias_tile)
        hits = (z >= threshold) & fresh[None, :]
        return counts + jnp.sum(hits, axis=1, dtype=jnp.int32)

    init = jnp.zeros((hidden.shape[0],), jnp.int32)
    with jax.named_scope("cut_count_at_least"):
        return jax.lax.fori_loop(0, num_tiles, body, init)
