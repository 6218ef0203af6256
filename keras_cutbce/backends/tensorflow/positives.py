"""The positives of a TensorFlow pass: masked in each tile, gathered for their exact terms.

The dense tiles skip a row's positives by setting them to `-inf` in the
tile's logits (`mask_positives`, one O(M L) scatter per tile, no per-logit
compare); the positives' own terms come from the table rows gathered at the
valid, de-duplicated ids (`keras_cutbce.math.positives.distinct_targets`,
found once per pass, `positive_logits`).
"""

import tensorflow as tf


def mask_positives(z, ids, start):
    """Returns the tile's logits `z` `[M, T]` with `-inf` at the row's positives: O(M L).

    The tile covers the items `[start, start + T)`. One `min` scatter of the
    `[M, L]` ids: a positive of the tile gets `-inf`; an id outside it
    (padding, other tiles) is sent to column 0 with `+inf`, which leaves
    `z` as it is (so every index is in bounds, and duplicates agree). At
    `-inf` a negative's term with no `softplus(-z)` part, and its slope,
    are exactly 0, so the dense pass adds nothing for a positive (no
    add-and-subtract of a saturated `softplus(z) ~ z`); with label smoothing
    the negatives' `softplus(-z)` part is infinite there, and `drop_masked`
    sets it to 0.

    Example:

    >>> mask_positives(tf.zeros([2, 4]), tf.constant([[5, 5], [-1, 9]]), 4).numpy().tolist()
    [[0.0, -inf, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
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


def drop_masked(values, z, coef):
    """Returns `values` with 0 where `mask_positives` put `-inf` (needed only with label smoothing).

    Example:

    >>> from keras_cutbce.math.coefficients import bce_coefficients
    >>> z = tf.constant([float("-inf"), 1.0])
    >>> drop_masked(tf.constant([5.0, 5.0]), z, bce_coefficients(0.1)).numpy().tolist()
    [0.0, 5.0]
    """
    if coef.neg_target == 0.0:
        return values
    return tf.where(tf.equal(z, float("-inf")), tf.zeros_like(values), values)


def positive_logits(hidden, table, bias, safe):
    """Returns the float32 logits `[M, L]` at the ids `safe` and the gathered rows `[M, L, D]`.

    Example:

    >>> hidden = tf.constant([[1.0, 2.0, 3.0]])
    >>> z, rows = positive_logits(hidden, tf.eye(3), None, tf.constant([[2, 0]]))
    >>> z.numpy().tolist(), tuple(rows.shape)
    ([[3.0, 1.0]], (1, 2, 3))
    """
    rows = tf.cast(tf.gather(table, safe), tf.float32)  # [M, L, D]
    z = tf.einsum("md,mld->ml", hidden, rows)
    if bias is not None:
        z = z + tf.cast(tf.gather(bias, safe), tf.float32)
    return z, rows
