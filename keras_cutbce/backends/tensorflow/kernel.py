"""The TensorFlow CutBCE kernel: a `tf.while_loop` over vocabulary tiles plus the positives.

The loss of one row is `(1/V) sum_v [minus_v softplus(-z_v) + plus_v
softplus(z_v)]` (`keras_cutbce.math.coefficients`). It is split in two:

- the negatives, with the weights `coef.negative_weights`, summed tile by
  tile over the vocabulary (`keras_cutbce.math.tiling.vocab_tiles`: `V //
  tile` full tiles in a `tf.while_loop`, then one narrower remainder tile),
  so the `[M, V]` logits never exist; each tile sets the row's positives to
  `-inf` in its logits (`mask_positives`), so their dense terms are exactly
  0 and nothing is added and subtracted back;
- the positives, with the weights `coef.positive_weights`: the table rows
  of the valid, de-duplicated ids (found once per pass) are gathered and
  their exact terms added, so saturated positives keep full float32
  precision at any `|z|` and any V.

Both call the one element-wise helper set `keras_cutbce.backends.
tensorflow.math` (`terms`, `slopes`, from one `exp(-|z|)` per logit). One
tile function (`_tile_pass`) computes what a pass needs from one logits
matmul: the per-row loss sum and/or, for a cotangent `row_scale` `[M]`,
the tile's `dZ @ E_tile` (hidden) and the tile's table and bias gradients,
with `dZ = row_scale / V * slopes(z)`. What is
TensorFlow's own: the loop is a `tf.while_loop` whose state holds the table gradient tiles in a
`TensorArray`; the caller compiles it with XLA. Everything accumulates in
float32.
"""

import tensorflow as tf

from keras_cutbce.backends.tensorflow.positives import mask_positives
from keras_cutbce.backends.tensorflow.positives import positive_logits
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import vocab_tiles

# Tiles in flight at once in graph mode; each matmul already uses every core.
_PARALLEL_ITERATIONS = 2


def tile_logits(hidden, table_tile, bias_tile=None):
    """Returns the float32 logits `[M, T]` of one vocabulary tile.

    Example:

    >>> tuple(tile_logits(tf.ones([2, 3]), tf.ones([4, 3]), tf.zeros([4])).shape)
    (2, 4)
    """
    z = tf.matmul(tf.cast(hidden, tf.float32), tf.cast(table_tile, tf.float32), transpose_b=True)
    if bias_tile is not None:
        z = z + tf.cast(bias_tile, tf.float32)
    return z


def _tiles_of(table, tile):
    """The `VocabTiles` of `table`: static Python ints where V is known (what XLA needs)."""
    static_vocab = table.shape[0]
    vocab_size = int(static_vocab) if static_vocab is not None else tf.shape(table)[0]
    return vocab_tiles(vocab_size, tile)


def _full_tile(table, bias, tiles, index):
    start = index * tiles.tile
    depth = table.shape[1] if table.shape[1] is not None else -1
    table_tile = tf.slice(table, [start, 0], [tiles.tile, depth])
    bias_tile = None if bias is None else tf.slice(bias, [start], [tiles.tile])
    return start, table_tile, bias_tile


def _remainder_tile(table, bias, tiles):
    start = tiles.remainder_start
    return start, table[start:], None if bias is None else bias[start:]


def _has_remainder(tiles):
    """Whether to build the remainder tile (always when V is unknown at trace time)."""
    return not isinstance(tiles.remainder, int) or tiles.remainder > 0


def _tile_pass(hidden, table_tile, bias_tile, ids, start, family, stats, *, loss, scaled_t, inv_v):
    """Returns one tile's negatives: `(loss_rows | None, tile_grads | None)`.

    `tile_grads = (hidden_part, table_part, bias_part)`.

    A family that `masks_positives` gets the row's positives at `-inf` in
    the logits (`mask_positives`, O(M L)); `family.tile` gives the tile's
    part of the rows' reduction and its slopes. With `scaled_t` given (`[row_scale h,
    row_scale].T`, `[D + 1, M]`), one plain matmul `scaled_t @ slopes(z)`
    times `inv_v` (`family.scale`, `1 / V`) gives the tile's table gradient, transposed,
    with the bias gradient in its last row. Only that small `[D + 1, T]`
    product is transposed, so the tiles stack into the `[V, D]` table
    gradient as they are. The `1 / V` is applied to the product rather than
    folded into `scaled_t` on purpose: without an op between them XLA
    folds the transpose into the matmul, whose transposed `[M, T]` operand
    is about three times slower on XLA's CPU backend. The row factors
    `row_scale / V` are applied to `hidden_part` by the caller (once, not
    per tile).
    """
    z = tile_logits(hidden, table_tile, bias_tile)
    if family.masks_positives:
        z = mask_positives(z, ids, start)
    loss_rows, slopes = family.tile(z, stats, loss=loss, grad=scaled_t is not None)
    if scaled_t is None:
        return loss_rows, None
    hidden_part = tf.matmul(slopes, tf.cast(table_tile, tf.float32))
    table_bias = tf.transpose(inv_v * tf.matmul(scaled_t, slopes))  # [T, D + 1]
    dim = tf.shape(table_tile)[1]
    return loss_rows, (hidden_part, table_bias[:, :dim], table_bias[:, dim])


def _dense_pass(hidden, table, bias, ids, family, tiles, stats=None, *, loss, row_scale=None):
    """Returns every tile's part: `(acc | None, (dh, dtable, dbias) | None)`.

    `acc` is the family's reduction of the rows (BCE: the sums of the
    negatives' terms); gradients (float32) are those of the dense terms
    weighted by `row_scale` times `family.scale` when `row_scale` is given.
    """
    want_grads = row_scale is not None
    inv_v = family.scale(tiles.vocab_size)
    scaled_t = None
    if want_grads:
        scaled_t = tf.concat(
            [tf.transpose(row_scale[:, None] * hidden), row_scale[None, :]], axis=0
        )

    def tile_pass(start, table_tile, bias_tile):
        return _tile_pass(
            hidden, table_tile, bias_tile, ids, start, family, stats,
            loss=loss, scaled_t=scaled_t, inv_v=inv_v,
        )

    rows = tf.shape(hidden)[0]
    dim = tf.shape(table)[1]
    state = []
    if loss:
        state.append(family.init(rows))
    if want_grads:
        # Full tiles only (XLA needs one element shape); the remainder is
        # concatenated at the end. Under XLA the stacked tiles are one
        # `[V, D]` buffer written in place.
        state += [
            tf.zeros_like(hidden),
            tf.TensorArray(tf.float32, size=tiles.num_full,
                           element_shape=[tiles.tile, table.shape[1]]),
            tf.TensorArray(tf.float32, size=tiles.num_full, element_shape=[tiles.tile]),
        ]

    def add(state, tile_out, index=None):
        tile_loss, tile_grads = tile_out
        state = list(state)
        k = 0
        if loss:
            state[0] = family.merge(state[0], tile_loss)
            k = 1
        if want_grads:
            hidden_part, table_part, bias_part = tile_grads
            state[k] = state[k] + hidden_part
            if index is not None:
                state[k + 1] = state[k + 1].write(index, table_part)
                state[k + 2] = state[k + 2].write(index, bias_part)
        return state

    if not (isinstance(tiles.num_full, int) and tiles.num_full == 0):
        out = tf.while_loop(
            lambda index, *_: index < tiles.num_full,
            lambda index, *st: (index + 1,) + tuple(
                add(st, tile_pass(*_full_tile(table, bias, tiles, index)), index)
            ),
            (tf.constant(0),) + tuple(state),
            maximum_iterations=tiles.num_full,
            parallel_iterations=_PARALLEL_ITERATIONS,
        )
        state = list(out[1:])
    rest = None
    if _has_remainder(tiles):
        rest = tile_pass(*_remainder_tile(table, bias, tiles))
        state = add(state, rest)
    loss_rows = state[0] if loss else None
    if not want_grads:
        return loss_rows, None
    k = 1 if loss else 0
    dh, table_tiles, bias_tiles = state[k], state[k + 1], state[k + 2]
    # [tiles, tile, D] -> [V, D]: a reshape, no copy.
    dtable = tf.reshape(table_tiles.stack(), [-1, dim])
    dbias = tf.reshape(bias_tiles.stack(), [-1])
    if rest is not None:
        dtable = tf.concat([dtable, rest[1][1]], axis=0)
        dbias = tf.concat([dbias, rest[1][2]], axis=0)
    return loss_rows, ((row_scale * inv_v)[:, None] * dh, dtable, dbias)


def loss_and_grads(hidden, table, ids, bias, family, tile, *, loss, row_scale=None):
    """Returns the per-row loss `[M]` and the float32 gradients of `sum_m row_scale_m loss_m`.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        ids: integer `[M, L]`.
        bias: float `[V]` or None.
        family: the loss family (`math.BCE`).
        tile: the tile width (a positive Python int).
        loss: whether to compute the loss.
        row_scale: optional cotangent `[M]`; gradients are computed when given.

    Returns:
        `(loss_rows, grads)`, `grads = (dh, dtable, dbias)` or None.
    """
    tiles = _tiles_of(table, tile)
    inv_v = family.scale(tiles.vocab_size)
    hidden = tf.cast(hidden, tf.float32)
    safe, keep = distinct_targets(ids, tiles.vocab_size)
    keep = tf.cast(keep, tf.float32)
    row_scale = None if row_scale is None else family.row_scale(tf.cast(row_scale, tf.float32), keep)
    acc = stats = None
    if family.two_pass and row_scale is not None:  # the row statistics first
        acc, _ = _dense_pass(hidden, table, bias, ids, family, tiles, loss=True)
        stats = family.statistics(acc)
    dense, grads = _dense_pass(
        hidden, table, bias, ids, family, tiles, stats, loss=loss and acc is None,
        row_scale=row_scale,
    )
    acc = dense if acc is None else acc
    if ids.shape[1] == 0:
        return (family.finish(acc, None, keep, inv_v) if loss else None), grads
    z_pos, rows_pos = positive_logits(hidden, table, bias, safe)
    terms, slopes = family.positives(z_pos, keep, loss=loss, grad=grads is not None)
    if loss:
        loss_rows = family.finish(acc, tf.reduce_sum(keep * terms, axis=1), keep, inv_v)
    if grads is not None:
        dh, dtable, dbias = grads
        dz = (row_scale * inv_v)[:, None] * keep * slopes
        dh = dh + tf.einsum("ml,mld->md", dz, rows_pos)
        index = tf.reshape(safe, [-1, 1])
        dtable_pos = tf.reshape(dz[:, :, None] * hidden[:, None, :], [-1, tf.shape(hidden)[1]])
        dtable = tf.tensor_scatter_nd_add(dtable, index, dtable_pos)
        dbias = tf.tensor_scatter_nd_add(dbias, index, tf.reshape(dz, [-1]))
        grads = (dh, dtable, dbias)
    return (loss_rows if loss else None), grads
