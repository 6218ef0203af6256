"""CutBCE on TensorFlow: `tf.custom_gradient` around a `tf.while_loop` over tiles."""

import tensorflow as tf


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    z = tf.matmul(tf.cast(hidden, tf.float32), tf.cast(table_tile, tf.float32), transpose_b=True)
    if bias_tile is not None:
        z = z + tf.cast(bias_tile, tf.float32)
    return z
