"""Top-k retrieval and rank counts on tensorflow, one `[M, T]` tile of logits at a time (the contract: the registry)."""

import tensorflow as tf

from keras_cutbce.backends.tensorflow.chunked import tile_logits
from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.tiling import vocab_tiles


def _tiles_of(table, tile):
    static_vocab = table.shape[0]
    return vocab_tiles(int(static_vocab) if static_vocab is not None else tf.shape(table)[0], tile)


def _tile_at(table, bias, start, tile):
    rows = tf.slice(table, tf.stack([start, 0]), tf.stack([tile, -1]))
    bias_tile = None
    if bias is not None:
        bias_tile = tf.slice(bias, tf.reshape(start, [1]), tf.reshape(tile, [1]))
    return start + tf.range(tile), rows, bias_tile


def _over_tiles(table, tile, step, init, name):
    tiles = _tiles_of(table, tile)
    with tf.name_scope(name):
        state = tf.while_loop(
            lambda index, *_: index < tiles.num_full,
            lambda index, *state: (
                (index + 1,) + tuple(step(index * tiles.tile, tiles.tile, *state))
            ),
            (tf.constant(0),) + tuple(init),
            parallel_iterations=1,
        )[1:]
        if not isinstance(tiles.remainder, int) or tiles.remainder > 0:
            state = step(tiles.remainder_start, tiles.remainder, *state)
    return state


def _excluded_mask(exclude_ids, start, tile):
    exclude_ids = tf.convert_to_tensor(exclude_ids)
    if not exclude_ids.dtype.is_integer:
        raise TypeError(f"exclude_ids must be integers; received {exclude_ids.dtype}.")
    wide = tf.int64 if exclude_ids.dtype in (tf.int64, tf.uint32, tf.uint64) else tf.int32
    local = tf.cast(exclude_ids, wide) - tf.cast(start, wide)
    inside = (local >= 0) & (local < tf.cast(tile, wide))
    local = tf.where(inside, tf.cast(local, tf.int32), tile)  # tile: dropped
    rows = tf.shape(exclude_ids)[0]
    row_index = tf.broadcast_to(tf.range(rows)[:, None], tf.shape(local))
    indices = tf.stack([row_index, local], axis=-1)
    counts = tf.scatter_nd(indices, tf.ones_like(local), tf.stack([rows, tile + 1]))
    return counts[:, :tile] > 0


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, chunk_size):
    """The retrieval `top_k` (the contract: `keras_cutbce.registry`)."""
    hidden = tf.convert_to_tensor(hidden)
    table = tf.convert_to_tensor(table)
    rows = tf.shape(hidden)[0]
    neg_inf = tf.constant(-float("inf"), tf.float32)

    def step(start, tile, best_scores, best_ids, nan_rows):
        columns, table_tile, bias_tile = _tile_at(table, bias, start, tile)
        z = tile_logits(hidden, table_tile, bias_tile)
        nan_rows = nan_rows | tf.reduce_any(tf.math.is_nan(z), axis=1, keepdims=True)
        if exclude_ids is not None:
            z = tf.where(_excluded_mask(exclude_ids, start, tile), neg_inf, z)
        # Running entries come first and have lower ids than the tile's, and
        # tf.math.top_k puts the lower index first among equal values: ties
        # go to the lower id.
        scores = tf.concat([best_scores, z], axis=1)
        columns = tf.broadcast_to(columns[None, :], tf.stack([rows, tile]))
        ids = tf.concat([best_ids, columns], axis=1)
        best_scores, position = tf.math.top_k(scores, k=k, sorted=True)
        return best_scores, tf.gather(ids, position, batch_dims=1), nan_rows

    init = (
        tf.fill(tf.stack([rows, k]), neg_inf),
        tf.fill(tf.stack([rows, k]), tf.constant(EMPTY_ID, tf.int32)),
        tf.zeros(tf.stack([rows, 1]), tf.bool),
    )
    scores, ids, nan_rows = _over_tiles(table, chunk_size, step, init, "cut_top_k")
    empty = (scores == neg_inf) | nan_rows
    ids = tf.where(empty, tf.constant(EMPTY_ID, tf.int32), ids)
    return tf.where(nan_rows, tf.constant(float("nan"), tf.float32), scores), ids


def count_above(hidden, table, bias, scores, ids, exclude_ids=None, *, chunk_size):
    """The retrieval `count_above` (the contract: `keras_cutbce.registry`)."""
    hidden = tf.convert_to_tensor(hidden)
    table = tf.convert_to_tensor(table)
    scores = tf.cast(scores, tf.float32)[:, None]
    ids = tf.cast(ids, tf.int32)[:, None]

    def step(start, tile, counts, nan_rows):
        columns, table_tile, bias_tile = _tile_at(table, bias, start, tile)
        z = tile_logits(hidden, table_tile, bias_tile)
        nan_rows = nan_rows | tf.reduce_any(tf.math.is_nan(z), axis=1)
        columns = columns[None, :]
        above = (z > scores) | ((z == scores) & (columns < ids))
        above = above & (columns != ids)
        if exclude_ids is not None:
            above = above & ~_excluded_mask(exclude_ids, start, tile)
        return counts + tf.reduce_sum(tf.cast(above, tf.int32), axis=1), nan_rows

    init = (tf.zeros(tf.shape(hidden)[:1], tf.int32), tf.zeros(tf.shape(hidden)[:1], tf.bool))
    counts, nan_rows = _over_tiles(table, chunk_size, step, init, "cut_count_above")
    return tf.where(nan_rows, -1, counts)
