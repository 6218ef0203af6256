"""CutBCE on TensorFlow: `tf.custom_gradient` around a `tf.while_loop` over tiles.

The loss of one row is `(1/V) sum_v [scale_v softplus(z_v) - target_v z_v]`
(see `keras_cutbce.coefficients`). It is split in three parts:

- the dense background `neg_scale * sum_v softplus(z_v)`, computed tile by
  tile over the vocabulary (`V // tile` full tiles in a `tf.while_loop`, then
  one narrower remainder tile), so the `[M, V]` logits never exist;
- the linear background `-neg_target * sum_v z_v = -neg_target (h . sum_v E_v
  + sum_v b_v)`, in closed form (nonzero only with label smoothing);
- a sparse correction at the positives: the table rows of the valid,
  de-duplicated ids are gathered and their logits get
  `delta_scale * softplus(z) - delta_target * z`.

The gradient recomputes the logits tile by tile: with `c = g * neg_scale / V`
for a cotangent `g [M]` and `S = sigmoid(Z_tile)`, the tile contributes
`S @ E_tile` (times `c`) to `d hidden`, `S^T @ (c h)` to its rows of
`d table` and `S^T c` to its `d bias`. Four matmuls and two elementwise
passes per logit in all; everything accumulates in float32.
"""

import tensorflow as tf

from keras_cutbce.coefficients import bce_coefficients


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    z = tf.matmul(tf.cast(hidden, tf.float32), tf.cast(table_tile, tf.float32), transpose_b=True)
    if bias_tile is not None:
        z = z + tf.cast(bias_tile, tf.float32)
    return z


def _softplus(z):
    """`log(1 + exp(z))`, stable for any float32 `z`.

    `tf.nn.softplus` is one fused kernel (`log1p(exp(z))`, switching to `z`
    or `exp(z)` at large `|z|`); under XLA it lowers to
    `max(z, 0) + log1p(exp(-|z|))`.
    """
    return tf.nn.softplus(z)


def _tile_softplus_sum(h32, e_tile, b_tile):
    """`sum_v softplus(z_v)` over one tile, per row `[M]`."""
    return tf.reduce_sum(_softplus(tile_logits(h32, e_tile, b_tile)), axis=1)


def _tile_sigmoid_grads(h32, ch, c, e_tile, b_tile):
    """One tile's `(S @ E_tile, S^T @ ch, S^T c)` with `S = sigmoid(Z_tile)`."""
    s = tf.sigmoid(tile_logits(h32, e_tile, b_tile))
    dh_part = tf.matmul(s, tf.cast(e_tile, tf.float32))
    de_tile = tf.matmul(s, ch, transpose_a=True)
    db_tile = tf.linalg.matvec(s, c, transpose_a=True)
    return dh_part, de_tile, db_tile


# Tiles in flight at once in graph mode; each matmul already uses every core.
_PARALLEL_ITERATIONS = 2


class _Tiling:
    """How the vocabulary `[0, V)` splits into `num_full` tiles of `tile` plus a remainder.

    Static Python ints where `V` is known (what XLA needs), tensors otherwise.
    """

    def __init__(self, table, tile):
        static_v = table.shape[0]
        vocab = int(static_v) if static_v is not None else tf.shape(table)[0]
        self.vocab = vocab
        self.tile = int(tile)
        self.num_full = vocab // self.tile
        self.start_rem = self.num_full * self.tile
        self.rem = vocab - self.start_rem
        # Known at trace time: skip the remainder tile when there is none.
        self.has_rem = not isinstance(self.rem, int) or self.rem > 0
        self.depth = table.shape[1] if table.shape[1] is not None else -1

    def full_tile(self, table, bias, i):
        start = i * self.tile
        e_tile = tf.slice(table, [start, 0], [self.tile, self.depth])
        b_tile = None if bias is None else tf.slice(bias, [start], [self.tile])
        return e_tile, b_tile

    def rem_tile(self, table, bias):
        e_tile = table[self.start_rem :]
        b_tile = None if bias is None else bias[self.start_rem :]
        return e_tile, b_tile


def _loop(tiling, body, state):
    """Runs `state = body(i, state)` for every full tile `i`."""
    if isinstance(tiling.num_full, int) and tiling.num_full == 0:
        return state

    def step(i, *state):
        return (i + 1,) + tuple(body(i, state))

    out = tf.while_loop(
        lambda i, *_: i < tiling.num_full,
        step,
        (tf.constant(0),) + tuple(state),
        maximum_iterations=tiling.num_full,
        parallel_iterations=_PARALLEL_ITERATIONS,
    )
    return out[1:]


def _dense_softplus_sum(h32, table, bias, tile):
    """`sum_v softplus(z_v)` per row `[M]`, tile by tile."""
    tiling = _Tiling(table, tile)

    def tile_sum(e_tile, b_tile):
        return _tile_softplus_sum(h32, e_tile, b_tile)

    def body(i, state):
        return (state[0] + tile_sum(*tiling.full_tile(table, bias, i)),)

    (acc,) = _loop(tiling, body, (tf.zeros([tf.shape(h32)[0]], tf.float32),))
    if tiling.has_rem:
        acc = acc + tile_sum(*tiling.rem_tile(table, bias))
    return acc


def _dense_sigmoid_grads(h32, table, bias, c, tile):
    """Gradients of `sum_m c_m sum_v softplus(z_mv)`: `(d h, d table, d bias)` in float32."""
    tiling = _Tiling(table, tile)
    ch = c[:, None] * h32

    def tile_grads(e_tile, b_tile):
        return _tile_sigmoid_grads(h32, ch, c, e_tile, b_tile)

    def body(i, state):
        dh, de_tiles, db_tiles = state
        dh_part, de_tile, db_tile = tile_grads(*tiling.full_tile(table, bias, i))
        return dh + dh_part, de_tiles.write(i, de_tile), db_tiles.write(i, db_tile)

    size = tiling.num_full
    de_tiles = tf.TensorArray(tf.float32, size=size, element_shape=[tiling.tile, table.shape[1]])
    db_tiles = tf.TensorArray(tf.float32, size=size, element_shape=[tiling.tile])
    dh = tf.zeros_like(h32)
    dh, de_tiles, db_tiles = _loop(tiling, body, (dh, de_tiles, db_tiles))
    de_parts = [tf.reshape(de_tiles.stack(), [-1, tf.shape(table)[1]])]
    db_parts = [tf.reshape(db_tiles.stack(), [-1])]
    if tiling.has_rem:
        dh_part, de_tile, db_tile = tile_grads(*tiling.rem_tile(table, bias))
        dh = dh + dh_part
        de_parts.append(de_tile)
        db_parts.append(db_tile)
    de = de_parts[0] if len(de_parts) == 1 else tf.concat(de_parts, axis=0)
    db = db_parts[0] if len(db_parts) == 1 else tf.concat(db_parts, axis=0)
    return c[:, None] * dh, de, db


def _positives(ids, vocab):
    """Safe int32 ids `[M, L]` and float32 weights: 1 for a valid first occurrence, else 0."""
    ids = tf.cast(ids, tf.int64)
    valid = tf.logical_and(ids >= 0, ids < tf.cast(vocab, tf.int64))
    safe = tf.where(valid, ids, tf.zeros_like(ids))
    num = tf.shape(ids)[1]
    earlier = tf.range(num)[:, None] > tf.range(num)[None, :]  # [j, k]: k before j
    same = tf.equal(safe[:, :, None], safe[:, None, :])
    same = tf.logical_and(same, valid[:, None, :])
    dup = tf.reduce_any(tf.logical_and(same, earlier[None]), axis=2)
    weight = tf.cast(tf.logical_and(valid, tf.logical_not(dup)), tf.float32)
    return tf.cast(safe, tf.int32), weight


def _positive_logits(h32, table, bias, safe):
    e_pos = tf.cast(tf.gather(table, safe), tf.float32)  # [M, L, D]
    z = tf.einsum("md,mld->ml", h32, e_pos)
    if bias is not None:
        z = z + tf.cast(tf.gather(bias, safe), tf.float32)
    return z, e_pos


def _forward_and_grad(hidden, table, ids, bias, coef, tile):
    """Loss `[M]` and a function of the cotangent returning `(d h, d table, d bias)`."""
    tiling = _Tiling(table, tile)
    inv_v = 1.0 / tf.cast(tiling.vocab, tf.float32)
    h32 = tf.cast(hidden, tf.float32)
    safe, weight = _positives(ids, tiling.vocab)
    z_pos, e_pos = _positive_logits(h32, table, bias, safe)

    total = coef.neg_scale * _dense_softplus_sum(h32, table, bias, tile)
    correction = coef.delta_scale * _softplus(z_pos) - coef.delta_target * z_pos
    total = total + tf.reduce_sum(weight * correction, axis=1)
    if coef.neg_target != 0.0:
        e_sum = tf.reduce_sum(tf.cast(table, tf.float32), axis=0)
        z_sum = tf.linalg.matvec(h32, e_sum)
        if bias is not None:
            z_sum = z_sum + tf.reduce_sum(tf.cast(bias, tf.float32))
        total = total - coef.neg_target * z_sum
    loss = total * inv_v

    def grad(g):
        g = tf.cast(g, tf.float32) * inv_v
        dh, de, db = _dense_sigmoid_grads(h32, table, bias, coef.neg_scale * g, tile)
        # Positives: d/dz of the correction, scattered to their table rows.
        dz = g[:, None] * weight * (coef.delta_scale * tf.sigmoid(z_pos) - coef.delta_target)
        dh = dh + tf.einsum("ml,mld->md", dz, e_pos)
        rows = tf.reshape(safe, [-1, 1])
        de_pos = tf.reshape(dz[:, :, None] * h32[:, None, :], [-1, tf.shape(h32)[1]])
        de = tf.tensor_scatter_nd_add(de, rows, de_pos)
        db = tf.tensor_scatter_nd_add(db, rows, tf.reshape(dz, [-1]))
        if coef.neg_target != 0.0:
            dh = dh - coef.neg_target * g[:, None] * e_sum[None, :]
            de = de - coef.neg_target * tf.linalg.matvec(h32, g, transpose_a=True)[None, :]
            db = db - coef.neg_target * tf.reduce_sum(g)
        return (
            tf.cast(dh, hidden.dtype),
            tf.cast(de, table.dtype),
            None if bias is None else tf.cast(db, bias.dtype),
        )

    return loss, grad


def cut_bce(hidden, table, ids, bias, *, label_smoothing, pos_weight, chunk_size):
    """Per-row CutBCE loss `[M]` in float32, with exact gradients for any cotangent.

    Args:
        hidden: float `[M, D]` (float32, bfloat16 or float16); `M` may be
            unknown statically.
        table: float `[V, D]` item table (a tensor, not a `tf.Variable`).
        ids: integer `[M, L]` target ids (`L` may be 0); ids outside `[0, V)`
            are padding and duplicates in a row count once.
        bias: float `[V]` or None.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile width, a positive Python int.

    Returns:
        Float32 loss `[M]`; gradients reach `hidden`, `table` and `bias` in
        their own dtypes.

    Example:

    >>> import numpy as np
    >>> h = tf.constant(np.random.normal(size=(4, 8)), tf.float32)
    >>> table = tf.constant(np.random.normal(size=(300, 8)), tf.float32)
    >>> ids = tf.constant([[1, 2], [3, -1], [5, 5], [299, 0]])
    >>> cut_bce(h, table, ids, None, label_smoothing=0.0, pos_weight=1.0,
    ...         chunk_size=128).shape
    TensorShape([4])
    """
    coef = bce_coefficients(label_smoothing, pos_weight)
    tile = int(chunk_size)
    hidden = tf.convert_to_tensor(hidden)
    table = tf.convert_to_tensor(table)
    ids = tf.convert_to_tensor(ids)

    if bias is None:

        @tf.custom_gradient
        def loss_without_bias(h, e, i):
            # stop_gradient: an eager GradientTape would otherwise record every
            # tile's ops and keep their [M, tile] intermediates alive.
            h, e = tf.stop_gradient(h), tf.stop_gradient(e)
            loss, grad = _forward_and_grad(h, e, i, None, coef, tile)

            def grad_fn(g):
                dh, de, _ = grad(g)
                return dh, de, None

            return loss, grad_fn

        return loss_without_bias(hidden, table, ids)

    bias = tf.convert_to_tensor(bias)

    @tf.custom_gradient
    def loss_with_bias(h, e, i, b):
        h, e, b = tf.stop_gradient(h), tf.stop_gradient(e), tf.stop_gradient(b)  # see above
        loss, grad = _forward_and_grad(h, e, i, b, coef, tile)

        def grad_fn(g):
            dh, de, db = grad(g)
            return dh, de, None, db

        return loss, grad_fn

    return loss_with_bias(hidden, table, ids, bias)
