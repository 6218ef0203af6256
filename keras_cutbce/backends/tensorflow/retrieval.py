"""Top-k retrieval and threshold counts on TensorFlow, tile by tile over the vocabulary.

Both functions run a `tf.while_loop` over vocabulary tiles (graph-friendly,
fine inside `tf.function`) holding one `[M, T]` tile of logits (from
`kernel.tile_logits`, the one fused tile function) plus the running result:
memory O(M * (k + T)) whatever V is.

Tiles all have the width `T = min(chunk_size, V)`. The last tile starts at
`V - T` instead of running past the table (no padded copy of the table); its
columns that the previous tile already covered are masked out.
"""

import tensorflow as tf

from keras_cutbce.backends.tensorflow.kernel import tile_logits

from keras_cutbce.common import EMPTY_ID


def _tiling(table, chunk_size):
    vocab_size = tf.shape(table)[0]
    width = tf.maximum(tf.minimum(tf.constant(int(chunk_size)), vocab_size), 1)
    num_tiles = (vocab_size + width - 1) // width
    return vocab_size, width, num_tiles


def _tile(table, bias, index, vocab_size, width):
    """Columns `[T]`, table rows `[T, D]`, bias `[T]` and fresh-column mask of a tile."""
    nominal = index * width
    start = tf.minimum(nominal, vocab_size - width)
    rows = tf.slice(table, tf.stack([start, 0]), tf.stack([width, -1]))
    bias_tile = None if bias is None else tf.slice(bias, [start], [width])
    columns = start + tf.range(width)
    return columns, rows, bias_tile, columns >= nominal


def _excluded_mask(exclude_ids, start, width):
    """Bool `[M, T]`: True where the row excludes the column `start + j`.

    Compared in the ids' own dtype before the int32 cast, so an int64 id
    `2**32 + j` never wraps onto column `j`.
    """
    exclude_ids = tf.convert_to_tensor(exclude_ids)
    if not exclude_ids.dtype.is_integer:
        raise TypeError(f"exclude_ids must be integers; received {exclude_ids.dtype}.")
    wide = tf.int64 if exclude_ids.dtype in (tf.int64, tf.uint32, tf.uint64) else tf.int32
    local = tf.cast(exclude_ids, wide) - tf.cast(start, wide)
    inside = (local >= 0) & (local < tf.cast(width, wide))
    local = tf.where(inside, tf.cast(local, tf.int32), width)  # width: dropped
    rows = tf.shape(exclude_ids)[0]
    row_index = tf.broadcast_to(tf.range(rows)[:, None], tf.shape(local))
    indices = tf.stack([row_index, local], axis=-1)
    counts = tf.scatter_nd(indices, tf.ones_like(local), tf.stack([rows, width + 1]))
    return counts[:, :width] > 0


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, chunk_size):
    """Exact top-k logits per row without the `[M, V]` logits.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        k: int in `[1, V]`.
        bias: optional float `[V]`.
        exclude_ids: optional int `[M, X]`: ids never returned for that row;
            ids outside `[0, V)` are ignored.
        chunk_size: vocabulary tile width.

    Returns:
        `(scores, ids)`: float32 `[M, k]` logits sorted descending (ties:
        lower id first, as a stable sort of `-logits`) and int32 `[M, k]`
        ids. Slots no item can fill (fewer than k items left after the
        exclusions) have score `-inf` and id `EMPTY_ID` (-1).

    Example:

    >>> h = tf.ones((1, 2))
    >>> table = tf.constant([[1.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    >>> scores, ids = top_k(h, table, 2, chunk_size=2)
    >>> ids.numpy().tolist(), scores.numpy().tolist()
    ([[1, 2]], [[3.0, 2.0]])
    """
    hidden = tf.convert_to_tensor(hidden)
    table = tf.convert_to_tensor(table)
    vocab_size, width, num_tiles = _tiling(table, chunk_size)
    rows = tf.shape(hidden)[0]
    neg_inf = tf.constant(-float("inf"), tf.float32)

    def body(index, best_scores, best_ids):
        columns, table_tile, bias_tile, fresh = _tile(table, bias, index, vocab_size, width)
        z = tile_logits(hidden, table_tile, bias_tile)
        drop = tf.logical_not(fresh)[None, :]
        if exclude_ids is not None:
            drop = drop | _excluded_mask(exclude_ids, columns[0], width)
        z = tf.where(drop, neg_inf, z)
        # Running entries come first and have lower ids than the tile's, and
        # tf.math.top_k puts the lower index first among equal values: ties
        # go to the lower id.
        scores = tf.concat([best_scores, z], axis=1)
        ids = tf.concat([best_ids, tf.broadcast_to(columns[None, :], [rows, width])], axis=1)
        best_scores, position = tf.math.top_k(scores, k=k, sorted=True)
        return index + 1, best_scores, tf.gather(ids, position, batch_dims=1)

    init = (
        tf.constant(0),
        tf.fill(tf.stack([rows, k]), neg_inf),
        tf.fill(tf.stack([rows, k]), tf.constant(EMPTY_ID, tf.int32)),
    )
    with tf.name_scope("cut_top_k"):
        _, scores, ids = tf.while_loop(
            lambda index, *_: index < num_tiles, body, init, parallel_iterations=1
        )
    return scores, tf.where(scores == neg_inf, tf.constant(EMPTY_ID, tf.int32), ids)


def count_at_least(hidden, table, bias, threshold, *, chunk_size):
    """Int32 `[M]`: how many of each row's V logits are `>= threshold`.

    Example:

    >>> h = tf.ones((1, 2))
    >>> table = tf.constant([[1.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    >>> count_at_least(h, table, None, 2.0, chunk_size=2).numpy().tolist()
    [2]
    """
    hidden = tf.convert_to_tensor(hidden)
    table = tf.convert_to_tensor(table)
    vocab_size, width, num_tiles = _tiling(table, chunk_size)

    def body(index, counts):
        _, table_tile, bias_tile, fresh = _tile(table, bias, index, vocab_size, width)
        z = tile_logits(hidden, table_tile, bias_tile)
        hits = tf.logical_and(z >= threshold, fresh[None, :])
        return index + 1, counts + tf.reduce_sum(tf.cast(hits, tf.int32), axis=1)

    init = (tf.constant(0), tf.zeros(tf.shape(hidden)[:1], tf.int32))
    with tf.name_scope("cut_count_at_least"):
        _, counts = tf.while_loop(
            lambda index, _: index < num_tiles, body, init, parallel_iterations=1
        )
    return counts
