"""The chunked implementation on TensorFlow: a `tf.while_loop` over vocabulary tiles, compiled by XLA.

`tf.custom_gradient` wraps the passes; each is a `tf.function(jit_compile=True)`
per option set and input signature, traced once (a V unknown at trace time
runs on the graph executor).
"""

import functools

import tensorflow as tf

from keras_cutbce.backends.tensorflow import math
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import vocab_tiles

# Tiles in flight at once in graph mode; each matmul already uses every core.
_PARALLEL_ITERATIONS = 2


def tile_logits(hidden, table_tile, bias_tile=None):
    """The float32 logits `[M, T]` of one vocabulary tile."""
    z = tf.matmul(tf.cast(hidden, tf.float32), tf.cast(table_tile, tf.float32), transpose_b=True)
    if bias_tile is not None:
        z = z + tf.cast(bias_tile, tf.float32)
    return z


def _tiles_of(table, tile):
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
    return not isinstance(tiles.remainder, int) or tiles.remainder > 0


def _tile_pass(hidden, table_tile, bias_tile, ids, start, family, stats, *, loss, scaled, bias_scale):
    """One tile: `(loss_rows | None, (hidden_part, table_part, bias_part | None) | None)`.

    The table's part is `slopes.T @ scaled`, both contracted on their rows as
    stored: XLA's CPU dot then needs no transpose (`[D, M] @ [M, T]`, then
    transposed, took about 2x the time).
    """
    z = tile_logits(hidden, table_tile, bias_tile)
    if family.masks_positives:
        z = mask_positives(z, ids, start)
    loss_rows, slopes = family.tile(z, stats, loss=loss, grad=scaled is not None)
    if scaled is None:
        return loss_rows, None
    hidden_part = tf.matmul(slopes, tf.cast(table_tile, tf.float32))
    table_part = tf.matmul(slopes, scaled, transpose_a=True)  # [T, D]
    bias_part = None
    if bias_tile is not None:  # without a bias: no third read of the slopes
        bias_part = tf.linalg.matvec(slopes, bias_scale, transpose_a=True)
    return loss_rows, (hidden_part, table_part, bias_part)


def _dense_pass(hidden, table, bias, ids, family, tiles, stats=None, *, loss, row_scale=None):
    want_grads = row_scale is not None
    scaled = None
    if want_grads:
        scaled = row_scale[:, None] * hidden

    def tile_pass(start, table_tile, bias_tile):
        return _tile_pass(
            hidden, table_tile, bias_tile, ids, start, family, stats,
            loss=loss, scaled=scaled, bias_scale=row_scale,
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
        ]
        if bias is not None:
            state.append(tf.TensorArray(tf.float32, size=tiles.num_full, element_shape=[tiles.tile]))

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
                if bias_part is not None:
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
    dh, table_tiles = state[k], state[k + 1]
    # [tiles, tile, D] -> [V, D]: a reshape, no copy.
    dtable = tf.reshape(table_tiles.stack(), [-1, dim])
    dbias = None if bias is None else tf.reshape(state[k + 2].stack(), [-1])
    if rest is not None:
        dtable = tf.concat([dtable, rest[1][1]], axis=0)
        dbias = None if bias is None else tf.concat([dbias, rest[1][2]], axis=0)
    return loss_rows, (row_scale[:, None] * dh, dtable, dbias)


def loss_and_grads(hidden, table, ids, bias, family, tile, *, loss, row_scale=None):
    """The per-row loss `[M]` and the float32 gradients of `sum_m row_scale_m loss_m` (when given; no bias: its None)."""
    tiles = _tiles_of(table, tile)
    vocab = tiles.vocab_size
    family = math.sized(family, vocab)
    hidden = tf.cast(hidden, tf.float32)
    safe, keep = distinct_targets(ids, vocab)
    keep = tf.cast(keep, tf.float32)
    positive_scale = None
    if row_scale is not None:
        row_scale, positive_scale = family.row_scale(tf.cast(row_scale, tf.float32), keep, vocab)
    acc = stats = None
    if family.two_pass and row_scale is not None:  # the row statistics first
        acc, _ = _dense_pass(hidden, table, bias, ids, family, tiles, loss=True)
        stats = family.statistics(acc)
    dense, grads = _dense_pass(
        hidden, table, bias, ids, family, tiles, stats, loss=loss and acc is None,
        row_scale=row_scale,
    )
    acc = dense if acc is None else acc
    positive_rows = None
    if ids.shape[1] != 0:
        positive_rows, grads = _add_positives(hidden, table, bias, safe, keep, family, grads,
                                              loss=loss, row_scale=positive_scale)
    if family.linear:
        rows, grads = _add_linear(hidden, table, bias, family, grads, loss=loss,
                                  row_scale=positive_scale)
        positive_rows = rows if positive_rows is None or rows is None else positive_rows + rows
    return (family.finish(acc, positive_rows, keep, vocab) if loss else None), grads


def _add_positives(hidden, table, bias, safe, keep, family, grads, *, loss, row_scale):
    z_pos, rows_pos = positive_logits(hidden, table, bias, safe)
    terms, slopes = family.positives(z_pos, keep, loss=loss, grad=grads is not None)
    positive_rows = tf.reduce_sum(keep * terms, axis=1) if loss else None
    if grads is not None:
        dh, dtable, dbias = grads
        dz = row_scale[:, None] * keep * slopes
        dh = dh + tf.einsum("ml,mld->md", dz, rows_pos)
        index = tf.reshape(safe, [-1, 1])
        dtable_pos = tf.reshape(dz[:, :, None] * hidden[:, None, :], [-1, tf.shape(hidden)[1]])
        dtable = tf.tensor_scatter_nd_add(dtable, index, dtable_pos)
        if dbias is not None:
            dbias = tf.tensor_scatter_nd_add(dbias, index, tf.reshape(dz, [-1]))
        grads = (dh, dtable, dbias)
    return positive_rows, grads


def _add_linear(hidden, table, bias, family, grads, *, loss, row_scale):
    """`-linear * sum_v z_v` a row in closed form (`h . sum_v E_v + sum_v b_v`) and its gradients."""
    table_sum = tf.reduce_sum(tf.cast(table, tf.float32), axis=0)
    rows = None
    if loss:
        rows = -family.linear * tf.linalg.matvec(hidden, table_sum)
        if bias is not None:
            rows = rows - family.linear * tf.reduce_sum(tf.cast(bias, tf.float32))
    if grads is not None:
        const = -family.linear * row_scale
        dh, dtable, dbias = grads
        grads = (dh + const[:, None] * table_sum,
                 dtable + tf.linalg.matvec(hidden, const, transpose_a=True)[None, :],
                 None if dbias is None else dbias + tf.reduce_sum(const))
    return rows, grads


def mask_positives(z, ids, start):
    """`z` `[M, T]` with `-inf` at the row's positives in `[start, start + T)`: one O(M L) `min` scatter."""
    tile = z.shape[1]
    if ids.shape[1] == 0 or tile == 0:
        return z
    if tile is None:
        # The remainder tile of a dynamic V may be empty, and a scatter into
        # `[M, 0]` fails: scatter into one more column (it can only take the
        # padding id V), then drop it.
        return _scatter_min(tf.pad(z, [[0, 0], [0, 1]]), ids, start)[:, :-1]
    return _scatter_min(z, ids, start)


def _scatter_min(z, ids, start):
    local = ids - tf.cast(start, ids.dtype)
    inside = tf.logical_and(local >= 0, local < tf.cast(tf.shape(z)[1], ids.dtype))
    column = tf.cast(tf.where(inside, local, tf.zeros_like(local)), tf.int32)
    rows = tf.broadcast_to(tf.range(tf.shape(ids)[0])[:, None], tf.shape(column))
    inf = tf.constant(float("inf"), z.dtype)
    updates = tf.where(inside, -inf, inf)
    return tf.tensor_scatter_nd_min(z, tf.stack([rows, column], axis=-1), updates)


def positive_logits(hidden, table, bias, safe):
    """The float32 logits `[M, L]` at the ids `safe` and the gathered rows `[M, L, D]`."""
    rows = tf.cast(tf.gather(table, safe), tf.float32)  # [M, L, D]
    z = tf.einsum("md,mld->ml", hidden, rows)
    if bias is not None:
        z = z + tf.cast(tf.gather(bias, safe), tf.float32)
    return z, rows


def _scaled(x, factor):
    return tf.cond(tf.equal(factor, 1.0), lambda: tf.identity(x), lambda: factor * x)


def _cast_grads(grads, hidden, table, bias, factor=None):
    dh, dtable, dbias = grads
    if factor is not None:
        dh, dtable = factor * dh, _scaled(dtable, factor)
        dbias = None if dbias is None else factor * dbias
    return (
        tf.cast(dh, hidden.dtype),
        tf.cast(dtable, table.dtype),
        None if bias is None else tf.cast(dbias, bias.dtype),
    )


def _with_gradient(fn, hidden, table, ids, bias):
    if bias is None:

        @tf.custom_gradient
        def without_bias(hidden, table, ids):
            value, grad = fn(tf.stop_gradient(hidden), tf.stop_gradient(table), ids, None)

            def grad_fn(cotangent):
                dh, dtable, _ = grad(cotangent)
                return dh, dtable, None

            return value, grad_fn

        return without_bias(hidden, table, ids)

    @tf.custom_gradient
    def with_bias(hidden, table, ids, bias):
        value, grad = fn(
            tf.stop_gradient(hidden), tf.stop_gradient(table), ids, tf.stop_gradient(bias)
        )

        def grad_fn(cotangent):
            dh, dtable, dbias = grad(cotangent)
            return dh, dtable, None, dbias

        return value, grad_fn

    return with_bias(hidden, table, ids, bias)


def _as_tensors(hidden, table, ids, bias):
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank == 1:
        ids = ids[:, None]
    return (
        tf.convert_to_tensor(hidden),
        tf.convert_to_tensor(table),
        ids,
        None if bias is None else tf.convert_to_tensor(bias),
    )


def cut_bce(hidden, table, ids, bias, *, label_smoothing, pos_weight, chunk_size):
    """The chunked `cut_bce` (the contract: `keras_cutbce.registry`)."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _per_row(family, hidden, table, ids, bias, chunk_size)


def _per_row(family, hidden, table, ids, bias, chunk_size):
    tile = int(chunk_size)
    hidden, table, ids, bias = _as_tensors(hidden, table, ids, bias)

    def per_row(hidden, table, ids, bias):
        loss_program, grad_program = _per_row_programs(
            family, tile, _specs(hidden, table, ids, bias), table.shape[0] is not None
        )
        loss = loss_program(hidden, table, ids, *_optional(bias))

        def grad(row_scale):
            row_scale = tf.cast(row_scale, tf.float32)
            grads = grad_program(hidden, table, ids, row_scale, *_optional(bias))
            return _cast_grads(grads, hidden, table, bias)

        return loss, grad

    return _with_gradient(per_row, hidden, table, ids, bias)


def _optional(bias):
    return () if bias is None else (bias,)


def _specs(hidden, table, ids, bias):
    specs = (
        tf.TensorSpec([None] + hidden.shape[1:].as_list(), hidden.dtype),
        tf.TensorSpec(table.shape, table.dtype),
        tf.TensorSpec([None] + ids.shape[1:].as_list(), ids.dtype),
    )
    return specs if bias is None else specs + (tf.TensorSpec(bias.shape, bias.dtype),)


_ROW_WEIGHTS = tf.TensorSpec([None], tf.float32)


def _program(body, specs, jit_compile):
    """`body` as a `tf.function` of `specs` (its own `functools.partial`: no retracing warning)."""
    return tf.function(body, input_signature=specs, jit_compile=jit_compile, autograph=False)


def _loss_body(family, tile, hidden, table, ids, bias=None):
    return loss_and_grads(hidden, table, ids, bias, family, tile, loss=True)[0]


def _grad_body(family, tile, hidden, table, ids, row_scale, bias=None):
    return loss_and_grads(hidden, table, ids, bias, family, tile, loss=False, row_scale=row_scale)[1]


def _fused_body(family, tile, hidden, table, ids, row_weights, bias=None):
    loss, (dh, dtable, dbias) = loss_and_grads(
        hidden, table, ids, bias, family, tile, loss=True, row_scale=row_weights
    )
    return tf.reduce_sum(row_weights * loss), dh, dtable, dbias


@functools.lru_cache(maxsize=64)
def _per_row_programs(family, tile, specs, static_vocab):
    """`cut_bce`'s `(loss_program, grad_program)`; an unknown V keeps the graph executor (XLA's slice would not fit)."""
    hidden, table, ids, *bias = specs
    loss_program = _program(functools.partial(_loss_body, family, tile), specs, static_vocab)
    grad_program = _program(
        functools.partial(_grad_body, family, tile),
        (hidden, table, ids, _ROW_WEIGHTS, *bias),
        static_vocab,
    )
    return loss_program, grad_program


@functools.lru_cache(maxsize=64)
def _fused_program(family, tile, specs):
    """The fused pass `(hidden, table, ids, row_weights[, bias]) -> (total, *grads)`, XLA (in-place tiles) where V is known."""
    hidden, table, ids, *bias = specs
    return _program(
        functools.partial(_fused_body, family, tile), (hidden, table, ids, _ROW_WEIGHTS, *bias),
        table.shape[0] is not None,
    )


def cut_bce_weighted_sum(
    hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight, chunk_size
):
    """The chunked `cut_bce_weighted_sum`: gradients computed with the loss, even when none is asked for."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _weighted_sum(family, hidden, table, ids, bias, row_weights, chunk_size)


def _weighted_sum(family, hidden, table, ids, bias, row_weights, chunk_size):
    tile = int(chunk_size)
    hidden, table, ids, bias = _as_tensors(hidden, table, ids, bias)
    weights = tf.stop_gradient(tf.reshape(tf.cast(row_weights, tf.float32), [-1]))

    def fused(hidden, table, ids, bias):
        total, *grads = _fused_program(family, tile, _specs(hidden, table, ids, bias))(
            hidden, table, ids, weights, *_optional(bias)
        )

        def grad(cotangent):
            return _cast_grads(grads, hidden, table, bias, factor=tf.cast(cotangent, tf.float32))

        return total, grad

    return _with_gradient(fused, hidden, table, ids, bias)


def _softmax(table, label_smoothing):
    vocab = table.shape[0]
    return math.Softmax(float(label_smoothing), None if vocab is None else int(vocab))


def cut_softmax(hidden, table, ids, bias, *, label_smoothing, chunk_size):
    """The chunked `cut_softmax`: `cut_bce`'s loop with `math.Softmax`."""
    family = _softmax(tf.convert_to_tensor(table), label_smoothing)
    return _per_row(family, hidden, table, ids, bias, chunk_size)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing,
                             chunk_size):
    """The chunked `cut_softmax_weighted_sum`."""
    family = _softmax(tf.convert_to_tensor(table), label_smoothing)
    return _weighted_sum(family, hidden, table, ids, bias, row_weights, chunk_size)
