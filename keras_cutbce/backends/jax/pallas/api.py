"""The Pallas entry points and their `pallas_call`s: settings, the `custom_vjp`, BCE and softmax (contract: `registry`).

Mosaic when compiled for a TPU, the interpreter otherwise (`compile_platform`);
16-bit hidden states keep their dtype in the matmuls, float32 accumulation.
The calls pad only the rows (zero `row_scale`, `EMPTY_ID` ids), never the
table, one call per resident row block, a block's table gradient aliased into
the next block's; JAX version shims use `getattr` with a fallback.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from keras_cutbce.backends.jax import compile_platform, math, vjp
from keras_cutbce.backends.jax.pallas.kernel import (accumulates_in_place, kernel, scratch_shapes,
                                                     uses_hit_bits)
from keras_cutbce.backends.jax.pallas import tiling
from keras_cutbce.backends.jax.pallas.tiling import Config, Pass, cores_used, num_tiles, row_blocks
from keras_cutbce.common import EMPTY_ID, round_up
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets

# -- The calls: rows laid out, one `pallas_call` per resident row block --------------------

MAX_PREFETCHED_COUNTS = 2**14  # in-tile id counts kept per row tile up to 64 KiB of SMEM
# The TPU interpreter mishandles aliased outputs with a partial last block
# (JAX 0.10.2), so interpreted passes copy the carried gradients instead;
# a test turns aliasing on at shapes whose blocks are all full.
INTERPRET_ALIASES = False
_SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None


def _traced_over_several_devices():
    """Whether the current trace's mesh (e.g. a `shard_map` body's) has more than one device."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    return bool(mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1)


def interpret_arg(interpret):
    """Returns `pallas_call`'s `interpret=` (the TPU interpreter; the generic one over several devices)."""
    if interpret is None:
        interpret = compile_platform.compiled_platform() != "tpu"
    if not interpret:
        return False
    params = getattr(pltpu, "InterpretParams", None)
    return params() if params is not None and not _traced_over_several_devices() else True


def _compiler_params(semantics, vmem_limit):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    kwargs = dict(dimension_semantics=semantics)
    if vmem_limit is not None:
        kwargs["vmem_limit_bytes"] = int(vmem_limit)
    return cls(**kwargs)


def _vmem_limit(cfg, block_rows, dim, hidden_itemsize, ps):
    """Returns the VMEM the pass asks for (`tiling.vmem_request_bytes`), or None: the default."""
    if cfg.vmem_capacity is None:
        return None
    resident = block_rows * tiling.resident_bytes_per_row(dim, cfg.num_ids, hidden_itemsize,
                                                          ps.with_grads)
    return tiling.vmem_request_bytes(cfg.vmem_capacity, tiling.config_footprint_bytes(cfg, dim),
                                     resident)


def _pad_rows(x, rows, value=0):
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=value)


def row_inputs(hidden, ids, row_scale, rows, cfg):
    """Returns the padded rows in the kernel's layout: hidden, sorted positives `[L, rows]`, `row_scale`."""
    hidden = _pad_rows(hidden, rows)
    hidden = hidden.T if cfg.dv_view else hidden
    if ids is not None:
        ids = _pad_rows(math.sorted_positives(ids, cfg.vocab_size), rows, EMPTY_ID).T
    if row_scale is not None:
        row_scale = _pad_rows(row_scale.astype(jnp.float32), rows)[None, :]
    return hidden, ids, row_scale


def in_tile_counts(ids_t, cfg):
    """Returns `[tiles, row tiles]` int32: the most positives one row of a row tile has in a tile."""
    ids = ids_t.T
    rows, length = ids.shape
    tiles = num_tiles(cfg)
    tile_of = jnp.where(ids >= 0, ids // cfg.tile, tiles)  # EMPTY_ID: dropped
    slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    starts = jnp.concatenate(
        [jnp.ones((rows, 1), bool), tile_of[:, 1:] != tile_of[:, :-1]], axis=1)
    rank = slot - lax.cummax(jnp.where(starts, slot, 0), axis=1)
    row_tile = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) // cfg.row_tile)[:, None],
                                ids.shape)
    counts = jnp.zeros((tiles, rows // cfg.row_tile), jnp.int32)
    return counts.at[tile_of, row_tile].max(rank + 1, mode="drop")


def _bias_row(bias):
    return None if bias is None else bias.astype(jnp.float32).reshape(1, -1)


def table_view(table, cfg):
    """Returns the table as the kernel reads it: `[D, V]` (a layout bitcast on TPU) or `[V, D]`."""
    return table.T if cfg.dv_view else table


def _cost(cfg, rows, dim, itemsize, ps):
    """Returns the `pl.CostEstimate` of one pass over the `[rows, V]` logits (for XLA)."""
    logits = rows * cfg.vocab_size
    matmuls = 3 if ps.with_grads else 1
    table = cfg.vocab_size * dim
    grad_bytes = (table * 4 * (2 if ps.carry else 1)) if ps.with_grads else 0
    return pl.CostEstimate(
        flops=int(2 * logits * dim * matmuls + 12 * logits),
        transcendentals=int(3 * logits),  # exp, log and a reciprocal a logit
        bytes_accessed=int(table * itemsize + grad_bytes
                           + rows * (dim * itemsize + 4 * cfg.num_ids + 8 + 4 * dim)),
    )


def _pass(hidden, table, bias, ids, row_scale, counts, carried, block, ps, cfg, lse=None,
          weights=None):
    """Runs one `pallas_call`: row block `block` against the whole table.

    Returns `(loss | None, grad_hidden | None, grad_table | None, grad_bias |
    None)`; softmax's loss is the rows' statistics (`passes`), its
    slopes take `lse` and the positives' `weights`.
    """
    dim = table.shape[1]
    tile, block_rows, per_core = cfg.tile, ps.block_rows, ps.tiles_per_core
    tiles, cores = num_tiles(cfg), cores_used(cfg)
    grid = (cores, per_core, block_rows // cfg.row_tile)

    def tile_of(core, j):
        return j if cores == 1 else jnp.minimum(core * per_core + j, tiles - 1)

    def table_spec():
        if cfg.dv_view:
            return pl.BlockSpec((dim, tile), lambda c, j, i, *_: (0, tile_of(c, j)))
        return pl.BlockSpec((tile, dim), lambda c, j, i, *_: (tile_of(c, j), 0))

    bias_spec = pl.BlockSpec((1, tile), lambda c, j, i, *_: (0, tile_of(c, j)))
    hidden_block = (dim, block_rows) if cfg.dv_view else (block_rows, dim)
    in_specs = [
        pl.BlockSpec(hidden_block, (lambda c, j, i, *_: (0, block)) if cfg.dv_view
                     else (lambda c, j, i, *_: (block, 0))),
    ]
    inputs = [hidden]
    if uses_hit_bits(cfg, ps.with_grads, ps.positive_sums):
        in_specs.append(pl.BlockSpec((ids.shape[0], block_rows), lambda c, j, i, *_: (0, block)))
        inputs.append(ids)
    row_spec = pl.BlockSpec((1, block_rows), lambda c, j, i, *_: (0, block))
    if ps.with_grads:
        in_specs.append(row_spec)
        inputs.append(row_scale)
        if cfg.softmax:
            in_specs.append(row_spec)
            inputs.append(lse)
        if cfg.softmax and cfg.positives:
            in_specs.append(row_spec)
            inputs.append(weights)
    in_specs.append(table_spec())
    inputs.append(table_view(table, cfg))
    if ps.has_bias:
        in_specs.append(bias_spec)
        inputs.append(_bias_row(bias))
    if ps.carry:
        in_specs += [table_spec()] + ([bias_spec] if ps.has_bias else [])
        inputs += list(carried)
    out_specs, out_shapes, scratch = [], [], []
    stats = (2 if cfg.softmax else 1) * ps.with_loss + ps.positive_sums
    out_specs += [pl.BlockSpec((_SQUEEZED, 1, block_rows), lambda c, j, i, *_: (c, 0, 0))] * stats
    out_shapes += [jax.ShapeDtypeStruct((cores, 1, block_rows), jnp.float32)] * stats
    aliases = {}
    if ps.with_grads:
        view = (dim, cfg.vocab_size) if cfg.dv_view else (cfg.vocab_size, dim)
        out_specs += [pl.BlockSpec((_SQUEEZED,) + hidden_block, lambda c, j, i, *_: (c, 0, 0)),
                      table_spec()]
        out_shapes += [jax.ShapeDtypeStruct((cores,) + hidden_block, jnp.float32),
                       jax.ShapeDtypeStruct(view, cfg.table_dtype)]
        if not accumulates_in_place(cfg):
            scratch.append(pltpu.VMEM((dim, tile) if cfg.dv_view else (tile, dim), jnp.float32))
        if ps.has_bias:
            out_specs.append(bias_spec)
            out_shapes.append(jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32))
    scratch += scratch_shapes(cfg, ps, dim, jnp.dtype(cfg.mm_dtype))
    if ps.with_grads and ps.carry:  # accumulate in place: the carried buffers are the outputs
        first_out = len(out_shapes) - 2 - ps.has_bias
        carry_in = 1 + len(inputs) - len(carried)  # operand 0: the prefetched counts
        aliases = {carry_in + k: first_out + 1 + k for k in range(len(carried))}
    name = "cutbce_fused" if ps.with_loss and ps.with_grads else (
        "cutbce_grads" if ps.with_grads else "cutbce_forward")
    if cfg.softmax:
        name = "cutsoftmax_grads" if ps.with_grads else "cutsoftmax_stats"

    def build(interpret, plain=False):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch)
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg, ps=ps, interpreted=bool(plain or interpret)),
            grid_spec=grid_spec,
            out_shape=out_shapes,
            # Without aliasing (interpreted) the numbers are the same, only
            # the carried buffers are not reused (`INTERPRET_ALIASES`).
            input_output_aliases=aliases if not interpret or INTERPRET_ALIASES else {},
            compiler_params=_compiler_params(
                ("parallel", "arbitrary", "arbitrary"),
                None if interpret else _vmem_limit(cfg, block_rows, dim, hidden.dtype.itemsize,
                                                   ps)),
            interpret=True if plain else interpret_arg(interpret),
            cost_estimate=_cost(cfg, block_rows, dim, table.dtype.itemsize, ps),
            name=name,
        )

    if cfg.interpret is None:  # target unknown at trace time: decided at lowering
        # The plain (effect-free) interpreter: `platform_dependent` cannot drop
        # the ordered effects of `pltpu.InterpretParams`'s callbacks.
        outs = compile_platform.by_platform((counts, *inputs), build(False), build(True, plain=True))
    else:
        outs = build(cfg.interpret)(counts, *inputs)
    outs = list(outs)
    if cfg.softmax:
        loss = _merge_cores(outs.pop(0)[:, 0], outs.pop(0)[:, 0]) if ps.with_loss else ()
        loss += (outs.pop(0).sum(axis=0)[0],) if ps.positive_sums else ()
    else:
        loss = outs.pop(0).sum(axis=0)[0] if ps.with_loss else None
    if not ps.with_grads:
        return loss, None, None, None
    # The kernel's hidden gradient is before the row scale (`kernel`).
    scale = row_scale[:, block * block_rows:(block + 1) * block_rows]
    grad_hidden = outs[0].sum(axis=0) * (scale if cfg.dv_view else scale.T)
    grad_table = outs[1]
    return loss, grad_hidden, grad_table, (outs[2] if ps.has_bias else None)


def _merge_cores(maxes, sums):
    """Returns the rows' `(max, sum exp)` `[rows]` of the TensorCores' `[cores, rows]` partials."""
    m = jnp.max(maxes, axis=0)
    return m, jnp.sum(sums * jnp.exp(maxes - m), axis=0)


def passes(hidden, table, bias, ids, row_scale, cfg, with_loss, lse=None, weights=None,
           positive_sums=False):
    """Returns the rows' loss sums `[M]` or None, and the gradients or None.

    Softmax's "loss" is a tuple of row statistics: `(max, sum exp)` with
    `with_loss`, then the sums of the positives' logits with `positive_sums`.
    The gradients are those of `sum_m row_scale_m loss_m` (softmax: of its
    slopes with `lse`, plus `weights_m` at the row's positives); one pass over
    the table per resident row block.
    """
    with_grads = row_scale is not None
    count, block_rows = row_blocks(hidden.shape[0], hidden.shape[1], hidden.dtype.itemsize, cfg,
                                   with_grads)
    padded = count * block_rows
    hit_bits = uses_hit_bits(cfg, with_grads, positive_sums)
    hidden_p, ids_p, row_scale_p = row_inputs(hidden, ids if hit_bits else None, row_scale,
                                              padded, cfg)
    per_core = pl.cdiv(num_tiles(cfg), cores_used(cfg))
    if lse is not None:  # padded rows: +inf, their slopes exp(z - inf) = 0
        lse = _pad_rows(lse.astype(jnp.float32), padded, jnp.inf)[None, :]
    if weights is not None:
        weights = _pad_rows(weights.astype(jnp.float32), padded)[None, :]
    if hit_bits:
        counts = in_tile_counts(ids_p, cfg)
    else:  # no ids in the tiles: the prefetched counts are a placeholder
        counts = jnp.zeros((num_tiles(cfg), padded // cfg.row_tile), jnp.int32)
    row_tiles = block_rows // cfg.row_tile
    per_row_tile = counts.shape[0] * row_tiles <= MAX_PREFETCHED_COUNTS
    losses, hidden_grads, carried = [], [], None
    for block in range(count):
        ps = Pass(bias is not None, with_loss, with_grads, carried is not None, block_rows,
                  per_core, per_row_tile, positive_sums)
        block_counts = counts[:, block * row_tiles : (block + 1) * row_tiles]
        block_counts = block_counts.reshape(-1) if per_row_tile else block_counts.max(axis=1)
        loss, grad_hidden, grad_table, grad_bias = _pass(
            hidden_p, table, bias, ids_p, row_scale_p, block_counts, carried, block, ps, cfg, lse,
            weights)
        losses.append(loss)
        hidden_grads.append(grad_hidden)
        if with_grads:
            carried = (grad_table,) + (() if bias is None else (grad_bias,))
    num_rows = hidden.shape[0]
    if cfg.softmax:
        loss = tuple(jnp.concatenate(parts)[:num_rows] for parts in zip(*losses))
    else:
        loss = jnp.concatenate(losses)[:num_rows] if with_loss else None
    if not with_grads:
        return loss, None
    if cfg.dv_view:
        grad_hidden = jnp.concatenate(hidden_grads, axis=1).T[:num_rows]
    else:
        grad_hidden = jnp.concatenate(hidden_grads, axis=0)[:num_rows]
    grad_bias = None if bias is None else carried[1][0]
    return loss, (grad_hidden, table_view(carried[0], cfg), grad_bias)


# -- The entry points --------------------------------------------------

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
