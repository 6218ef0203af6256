"""CutBCE on TensorFlow: `tf.custom_gradient` around the tile loop, compiled by XLA.

`cut_bce` (any cotangent) runs a loss pass forward and a gradient pass
backward; `cut_bce_weighted_sum` (the training path of a reduced loss: the
row weights are constants) runs one pass computing the loss and the
gradients at cotangent 1, and its backward pass only scales them. Both run
`keras_cutbce.backends.tensorflow.kernel` (the tile loop; its element-wise
math is `keras_cutbce.backends.tensorflow.math`).

What is TensorFlow's own here: the autograd mechanism (`tf.custom_gradient`,
inputs `stop_gradient`-ed inside so an eager tape records no tile), and the
compilation: every pass is a `tf.function(jit_compile=True)`, one per
option set and input signature, traced once and never retraced (the rows
are left unknown; XLA compiles per concrete size), the graph executor when
V is unknown at trace time.
The public op (`keras_cutbce.ops`) has checked every argument: these entry
points trust it.
"""

import functools

import tensorflow as tf

from keras_cutbce.backends.tensorflow import math
from keras_cutbce.backends.tensorflow.kernel import loss_and_grads
from keras_cutbce.math.coefficients import bce_coefficients


def _scaled(x, factor):
    """`factor * x`, without a new `[V, D]` buffer when `factor` is 1 (the usual cotangent)."""
    return tf.cond(tf.equal(factor, 1.0), lambda: tf.identity(x), lambda: factor * x)


def _cast_grads(grads, hidden, table, bias, factor=None):
    dh, dtable, dbias = grads
    if factor is not None:
        dh, dtable, dbias = factor * dh, _scaled(dtable, factor), factor * dbias
    return (
        tf.cast(dh, hidden.dtype),
        tf.cast(dtable, table.dtype),
        None if bias is None else tf.cast(dbias, bias.dtype),
    )


def _with_gradient(fn, hidden, table, ids, bias):
    """Returns `fn`'s value, with `fn`'s gradient as its `tf.custom_gradient`.

    `fn(hidden, table, ids, bias) -> (value, grad_fn)`, with
    `grad_fn(cotangent) -> (dh, dtable, dbias)`.

    Inputs are `stop_gradient`-ed inside: an eager `GradientTape` would
    otherwise record every tile's ops and keep their `[M, tile]`
    intermediates alive.
    """
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
    """Computes the per-row CutBCE loss `[M]` in float32, with exact gradients for any cotangent.

    Args:
        hidden: float `[M, D]` (float32, bfloat16 or float16); `M` may be
            unknown statically.
        table: float `[V, D]` item table (a tensor, not a `tf.Variable`).
        ids: integer `[M, L]` target ids (`L` may be 0); ids outside `[0, V)`
            are padding and duplicates in a row count once.
        bias: float `[V]` or None.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile width, a positive Python int (checked
            by the public op).

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
    """The input signature of a program: every static size but the number of rows.

    The rows `M` are left unknown, so a program is traced once per option
    set and serves every batch size (XLA still compiles per concrete
    size); the vocabulary, the width, the number of target columns and the
    dtypes are part of the key.
    """
    specs = (
        tf.TensorSpec([None] + hidden.shape[1:].as_list(), hidden.dtype),
        tf.TensorSpec(table.shape, table.dtype),
        tf.TensorSpec([None] + ids.shape[1:].as_list(), ids.dtype),
    )
    return specs if bias is None else specs + (tf.TensorSpec(bias.shape, bias.dtype),)


_ROW_WEIGHTS = tf.TensorSpec([None], tf.float32)


def _program(body, specs, jit_compile):
    """Returns `body` (a `functools.partial` binding the options) as a `tf.function` of `specs`.

    One `tf.function` per option set, cached by the caller, with a fixed
    input signature: it is traced once and never retraced. Each wraps its
    own `functools.partial` object, which TensorFlow's retracing detector
    tells apart (it groups functions by their code object), so compiling a
    program for a new option set is not reported as retracing another.
    """
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
    """Returns `cut_bce`'s two passes, compiled by XLA: `(loss_program, grad_program)`.

    `loss_program(hidden, table, ids[, bias]) -> loss [M]`;
    `grad_program(hidden, table, ids, row_scale[, bias]) -> (dh, dtable,
    dbias)` float32, the gradients of `sum_m row_scale_m loss_m` (it
    recomputes the logits tile by tile). Cached per option set and input
    signature (`_specs`). Compiled, each tile's elementwise work is one
    fused pass (one `exp` per logit shared by softplus and sigmoid), which
    TensorFlow's graph executor would run as a kernel per op. A V unknown
    at trace time (`static_vocab=False`) keeps the graph executor: XLA
    would compile the tile loop's body for a V smaller than a tile, where
    it never runs but its slice does not fit.
    """
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
    """Returns the fused pass, `(hidden, table, ids, row_weights[, bias]) -> (total, *grads)`.

    `total = sum_m row_weights_m loss_m`, and its float32 gradients
    `(dh, dtable, dbias)`, compiled by XLA: XLA runs the tile loop with the
    table gradient tiles written in place into one buffer (TensorFlow's
    graph executor would keep the tiles and their stacked copy, and copy
    again for the positives' scatter-add). Cached per option set and input
    signature (`_specs`); XLA compiles per concrete number of rows.
    """
    hidden, table, ids, *bias = specs
    return _program(
        functools.partial(_fused_body, family, tile), (hidden, table, ids, _ROW_WEIGHTS, *bias), True
    )


def cut_bce_weighted_sum(
    hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight, chunk_size
):
    """Computes `sum_m row_weights[m] * cut_bce(...)[m]`, its gradients computed with the loss.

    The fused training path of a reduced loss (sample weights, masks and the
    reduction's divisor are the row weights, constants without gradient).
    One pass over the vocabulary tiles computes the loss and the gradients
    at cotangent 1 (per tile one logits matmul, one softplus, one sigmoid
    and the three gradient products), compiled by XLA (`_fused_program`);
    the backward pass only scales them by the upstream cotangent. The gradients are computed even when none is
    asked for (TensorFlow cannot tell in the forward pass): call `cut_bce`
    for evaluation.

    Args:
        hidden: float `[M, D]`; `M` may be unknown statically.
        table: float `[V, D]` item table (a tensor).
        ids: integer `[M, L]` target ids; ids outside `[0, V)` are padding,
            duplicates count once.
        bias: float `[V]` or None.
        row_weights: float `[M]` row weights (no gradient flows to them).
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile width, a positive Python int (checked
            by the public op).

    Returns:
        A float32 scalar; gradients reach `hidden`, `table` and `bias` in
        their own dtypes.

    Example:

    >>> import numpy as np
    >>> h = tf.constant(np.random.normal(size=(3, 8)), tf.float32)
    >>> table = tf.constant(np.random.normal(size=(100, 8)), tf.float32)
    >>> ids = tf.constant([[1, 2], [3, -1], [5, 5]])
    >>> w = tf.constant([1.0, 0.0, 0.5])
    >>> total = cut_bce_weighted_sum(h, table, ids, None, w, label_smoothing=0.0,
    ...                              pos_weight=1.0, chunk_size=32)
    >>> per_row = cut_bce(h, table, ids, None, label_smoothing=0.0, pos_weight=1.0,
    ...                   chunk_size=32)
    >>> bool(np.isclose(total, tf.reduce_sum(w * per_row), rtol=1e-5))
    True
    """
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
    if vocab is None:
        raise NotImplementedError("The softmax loss needs the vocabulary size known at trace time.")
    return math.Softmax(float(label_smoothing), int(vocab))


def cut_softmax(hidden, table, ids, bias, *, label_smoothing, chunk_size):
    """Computes the per-row softmax cross-entropy `[M]` in float32, with exact gradients.

    The loop of `cut_bce` with the `math.Softmax` family (two passes over
    the tiles for the gradients: the rows' log-sum-exp, then the slopes).
    Arguments as `cut_bce`'s, without `pos_weight`; V must be static.

    Example:

    >>> z = tf.math.log(tf.constant([[1.0, 2.0, 1.0]]))
    >>> loss = cut_softmax(z, tf.eye(3), tf.constant([[1]]), None, label_smoothing=0.0,
    ...                    chunk_size=2)
    >>> round(float(loss[0]), 4)
    0.6931
    """
    family = _softmax(tf.convert_to_tensor(table), label_smoothing)
    return _per_row(family, hidden, table, ids, bias, chunk_size)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing,
                             chunk_size):
    """Computes `sum_m row_weights[m] * cut_softmax(...)[m]`, as `cut_bce_weighted_sum`."""
    family = _softmax(tf.convert_to_tensor(table), label_smoothing)
    return _weighted_sum(family, hidden, table, ids, bias, row_weights, chunk_size)
