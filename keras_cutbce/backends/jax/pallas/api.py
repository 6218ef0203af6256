"""The Pallas entry points: settings, the `custom_vjp`, BCE and softmax (contract: `registry`).

Mosaic when compiled for a TPU, the interpreter otherwise (`compile_platform`);
16-bit hidden states keep their dtype in the matmuls, float32 accumulation.
"""

import functools

import jax.numpy as jnp
from jax import lax

from keras_cutbce.backends.jax import compile_platform, math, vjp
from keras_cutbce.backends.jax.pallas import tiling
from keras_cutbce.backends.jax.pallas.tiling import Config
from keras_cutbce.backends.jax.pallas.call import passes
from keras_cutbce.common import EMPTY_ID, round_up
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets

_PRECISIONS = {"default": None, "highest": lax.Precision.HIGHEST}


def _matmul_dtype(hidden, table):
    """Returns the hidden states' dtype when 16-bit (mixed precision), else the promoted one."""
    if jnp.dtype(hidden.dtype).itemsize == 2:
        return jnp.dtype(hidden.dtype).name
    return jnp.result_type(hidden.dtype, table.dtype).name


def _resolve_interpret(interpret):
    """Returns True/False when asked or when the target is known at trace time, else None."""
    if interpret is not None:
        return bool(interpret)
    platform = compile_platform.compiled_platform()
    return None if platform is None else platform != "tpu"


def prepare(hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows,
            interpret, precision="default", family="bce"):
    """Returns `(cfg, hidden, table, bias, ids)`: the call's `Config` and its arrays."""
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    bias = None if bias is None else jnp.asarray(bias)
    ids = jnp.asarray(ids)
    assert ids.ndim == 2, ids.shape
    if ids.shape[1] == 0:  # No positives: one padding id keeps shapes non-empty.
        ids = jnp.full((hidden.shape[0], 1), EMPTY_ID, jnp.int32)
    if precision not in _PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {sorted(_PRECISIONS)}. Received: precision={precision!r}"
        )
    num_rows, dim = hidden.shape
    vocab_size = table.shape[0]
    mm_dtype = _matmul_dtype(hidden, table)
    capacity = tiling.vmem_capacity_bytes()
    tiles = tiling.choose_tiles(num_rows, vocab_size, dim, mm_dtype,
                                tiling.tile_budget_bytes(capacity), table.dtype)
    rows_tile, tile = tiles
    if chunk_size is not None:
        tile = min(round_up(chunk_size, tiling.LANES), round_up(vocab_size, tiling.LANES),
                   tiling.MAX_TILE)
    if block_rows is not None:
        rows_tile = min(round_up(block_rows, tiling.LANES),
                        round_up(max(num_rows, 1), tiling.LANES))
    cfg = Config(
        vocab_size=int(vocab_size),
        coef=(math.Softmax(float(label_smoothing), int(vocab_size)) if family == "softmax"
              else bce_coefficients(label_smoothing, pos_weight)),
        row_tile=int(rows_tile),
        tile=int(tile),
        num_ids=int(ids.shape[1]),
        mm_dtype=mm_dtype,
        interpret=_resolve_interpret(interpret),
        vmem_capacity=capacity,
        precision=_PRECISIONS[precision],
        table_dtype=jnp.dtype(table.dtype).name,
        dv_view=dim % tiling.LANES != 0,
        cores=int(tiling.tensorcores()),
        family=family,
        newton_reciprocal=tiling.newton_reciprocal(),
    )
    return cfg, hidden, table, bias, ids


@functools.lru_cache(maxsize=128)
def _functions(cfg):
    """Returns the differentiable `(per_row_loss, weighted_sum)` of one configuration."""
    vocab = cfg.vocab_size

    def loss_fn(hidden, table, ids, bias):
        return passes(hidden, table, bias, ids, None, cfg, with_loss=True)[0] / vocab

    def grads_fn(hidden, table, ids, bias, row_scale):
        return passes(hidden, table, bias, ids, row_scale / vocab, cfg, with_loss=False)[1]

    def loss_and_grads_fn(hidden, table, ids, bias, row_weights):
        sums, grads = passes(hidden, table, bias, ids, row_weights / vocab, cfg, with_loss=True)
        return sums / vocab, grads

    return (vjp.per_row_loss(loss_fn, grads_fn),
            vjp.weighted_sum(loss_fn, loss_and_grads_fn))


def cut_bce(
    hidden,
    table,
    ids,
    bias=None,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    block_rows=None,
    interpret=None,
    precision="default",
):
    """Per-row CutBCE `[M]` float32 (`registry`'s contract); Pallas options below.

    `chunk_size`/`block_rows`: vocabulary/row tile (rounded up to 128; None: the
    tile rule); `interpret`: None follows the target; `precision`: `"default"`
    or `"highest"` float32 matmuls.

    >>> import numpy as np
    >>> loss = cut_bce(np.zeros((3, 4), "float32"), np.zeros((10, 4), "float32"), np.array([[1], [2], [-1]]))
    >>> bool(np.allclose(loss, np.log(2.0)))
    True
    """
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret,
        precision,
    )
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return _functions(cfg)[0](hidden, table, ids, bias)


def cut_bce_weighted_sum(
    hidden,
    table,
    ids,
    bias,
    row_weights,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    block_rows=None,
    interpret=None,
    precision="default",
):
    """`sum_m row_weights[m] * cut_bce(...)[m]`; loss and gradients in one kernel pass."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret,
        precision,
    )
    row_weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return _functions(cfg)[1](hidden, table, ids, bias, row_weights)


def _softmax_loss_and_grads(hidden, table, ids, bias, cfg, *, loss, row_weights=None):
    """Softmax's loss `[M]` (or None) and gradients (or None), as `chunked`'s loop does.

    A statistics pass gives the log-sum-exp, the gradient pass takes it and adds
    each row's positive weight at its hit bits; the positives' logit sums come
    from the last pass (no gather or scatter over the table); label smoothing's
    sum is exact outside.
    """
    family = cfg.coef
    _, keep = distinct_targets(ids, cfg.vocab_size)
    grads_pass = row_weights is not None
    stats, _ = passes(hidden, table, bias, ids, None, cfg, with_loss=True,
                      positive_sums=loss and not grads_pass)
    # Each row's positive slope, -(1 - a) / |P|: its positives' loss is `weight * sum z_p`.
    weight = family.positives(stats[0][:, None], keep, loss=False, grad=True)[1][:, 0]
    grads = None
    if grads_pass:
        row_scale, _ = family.row_scale(row_weights, keep, cfg.vocab_size)  # one factor: no `linear`
        sums, grads = passes(hidden, table, bias, ids, row_scale, cfg, with_loss=False,
                             lse=family.statistics(stats[:2]), weights=weight,
                             positive_sums=loss)
        stats += sums
        grads = (grads[0], grads[1].astype(jnp.float32), grads[2])
    if not loss:
        return None, grads
    m, s, positive_sums = stats
    positive_rows = weight * positive_sums
    total = jnp.zeros_like(m)
    if family.label_smoothing:
        total = jnp.matmul(hidden.astype(jnp.float32), jnp.sum(table.astype(jnp.float32), axis=0),
                           precision=lax.Precision.HIGHEST)
        total = total if bias is None else total + jnp.sum(bias.astype(jnp.float32))
    return family.finish((m, s, total), positive_rows, keep, cfg.vocab_size), grads


@functools.lru_cache(maxsize=128)
def _softmax_functions(cfg):
    """Returns the differentiable `(per_row_loss, weighted_sum)` of one softmax configuration."""

    def loss_fn(hidden, table, ids, bias):
        return _softmax_loss_and_grads(hidden, table, ids, bias, cfg, loss=True)[0]

    def grads_fn(hidden, table, ids, bias, row_weights):
        return _softmax_loss_and_grads(hidden, table, ids, bias, cfg, loss=False,
                                       row_weights=row_weights)[1]

    def loss_and_grads_fn(hidden, table, ids, bias, row_weights):
        return _softmax_loss_and_grads(hidden, table, ids, bias, cfg, loss=True,
                                       row_weights=row_weights)

    return (vjp.per_row_loss(loss_fn, grads_fn),
            vjp.weighted_sum(loss_fn, loss_and_grads_fn))


def softmax_statistics(hidden, table, bias, *, chunk_size=None, interpret=None):
    """Returns the rows' `(max, sum_v exp(z_v - max))`, float32 `[M]` each (no gradient)."""
    cfg, hidden, table, bias, ids = prepare(hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
                                            0.0, 1.0, chunk_size, None, interpret,
                                            family="softmax")
    return passes(hidden, table, bias, ids, None, cfg._replace(positives=False), with_loss=True)[0]


def softmax_gradients(hidden, table, bias, lse, row_scale, *, chunk_size=None, interpret=None):
    """Returns the float32 gradients of `sum_m row_scale_m sum_v exp(z_mv - lse_m)` (no smoothing)."""
    cfg, hidden, table, bias, ids = prepare(hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
                                            0.0, 1.0, chunk_size, None, interpret,
                                            family="softmax")
    grads = passes(hidden, table, bias, ids, row_scale, cfg._replace(positives=False),
                   with_loss=False, lse=lse)[1]
    return grads[0], grads[1].astype(jnp.float32), grads[2]


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None,
                block_rows=None, interpret=None, precision="default"):
    """`cut_bce` for the softmax cross-entropy (`math.Softmax`), float32 `[M]`."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, label_smoothing, 1.0, chunk_size, block_rows, interpret,
        precision, family="softmax")
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return _softmax_functions(cfg)[0](hidden, table, ids, bias)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing=0.0,
                             chunk_size=None, block_rows=None, interpret=None,
                             precision="default"):
    """`cut_bce_weighted_sum` for softmax: a statistics pass, then the gradient pass."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, label_smoothing, 1.0, chunk_size, block_rows, interpret,
        precision, family="softmax")
    row_weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return _softmax_functions(cfg)[1](hidden, table, ids, bias, row_weights)
