"""The dense reference: each loss on the dense float32 logits in `keras.ops` (`implementation="reference"`, small shapes).

Float32 as Keras's dense losses, not a float64 oracle: that is `keras_cutbce.math.spec`.
"""

from keras import ops

from keras_cutbce.math.coefficients import bce_coefficients


def multi_hot(ids, vocab_size):
    """The float32 `[rows, V]` multi-hot of ids `[rows, L]` (padding ignored, duplicates once)."""
    ids = ops.convert_to_tensor(ids)
    rows = ops.shape(ids)[0]
    if ids.shape[-1] == 0:
        return ops.zeros((rows, vocab_size), "float32")
    valid = ops.logical_and(ids >= 0, ids < vocab_size)
    safe = ops.where(valid, ids, ops.zeros_like(ids))
    hot = ops.one_hot(safe, vocab_size, dtype="float32")
    hot = hot * ops.expand_dims(ops.cast(valid, "float32"), -1)
    return ops.minimum(ops.sum(hot, axis=1), 1.0)  # (a max fails on zero rows on torch and TF)


def logits(hidden, table, bias=None):
    """Returns the float32 `hidden @ table.T + bias`, computed densely."""
    z = ops.matmul(ops.cast(hidden, "float32"), ops.transpose(ops.cast(table, "float32")))
    if bias is not None:
        z = z + ops.cast(bias, "float32")
    return z


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0):
    """The dense `cut_bce` (the contract: `keras_cutbce.registry`)."""
    coef = bce_coefficients(label_smoothing, pos_weight)
    z = logits(hidden, table, bias)
    y = multi_hot(ids, ops.shape(table)[0])
    # `p y' softplus(-z) + (1 - y') softplus(z)`: two non-negative parts, no
    # cancellation at saturated logits (see `keras_cutbce.math.coefficients`).
    weight_minus = coef.neg_target + (coef.pos_minus - coef.neg_target) * y
    weight_plus = (coef.neg_scale - coef.neg_target) + (
        coef.pos_plus - (coef.neg_scale - coef.neg_target)
    ) * y
    terms = weight_minus * ops.softplus(-z) + weight_plus * ops.softplus(z)
    return ops.mean(terms, axis=-1)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0):
    """The dense `cut_softmax`: `keras.losses.categorical_crossentropy` on `multi_hot / |P|`, 0 without a valid id."""
    z = logits(hidden, table, bias)
    y = multi_hot(ids, ops.shape(table)[0])
    count = ops.sum(y, axis=-1)
    y = y / ops.expand_dims(ops.maximum(count, 1.0), -1)
    a = float(label_smoothing)
    y = y * (1.0 - a) + a / ops.shape(table)[0]
    # An item without target weight adds nothing, even at a logit of -inf (not `0 * -inf`).
    loss = ops.logsumexp(z, axis=-1) - ops.sum(ops.where(y > 0, y * z, 0.0), axis=-1)
    return ops.where(count > 0, loss, 0.0)


def cut_sampled_softmax(hidden, table, ids, bias, negatives, *, log_q=None, negative_log_q=None,
                        remove_accidental_hits=True, temperature=1.0):
    """The dense `cut_sampled_softmax`: the candidates' columns of the dense float32 logits."""
    from keras_cutbce.math.positives import distinct_targets
    from keras_cutbce.math.sampled import candidate_logits
    from keras_cutbce.math.sampled import sampled_softmax_loss

    z = logits(hidden, table, bias)
    safe, keep = distinct_targets(ids, ops.shape(table)[0])
    z_n = ops.take(z, ops.where(negatives < 0, ops.zeros_like(negatives), negatives), axis=1)
    z_t, z_n = candidate_logits(ops.take_along_axis(z, safe, axis=1), z_n, safe, keep, negatives,
                                log_q=log_q, negative_log_q=negative_log_q,
                                remove_accidental_hits=remove_accidental_hits,
                                temperature=temperature)
    return sampled_softmax_loss(z_t, z_n, keep)
