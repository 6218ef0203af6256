"""The Pallas path on the host (contract: `registry`): entry points, settings, passes, `pallas_call`s.

`prepare` checks the arrays, de-duplicates and sorts each row's ids once and
builds the call's static `Config` with its loss family (`kernel.BCE`,
`kernel.Softmax`) and its plan; `functions` puts the family's passes under
`jax.custom_vjp`; `passes` lays the rows out (padded, never the table) and
makes one `pallas_call` per resident row block, a block's table gradient
aliased into the next block's. Mosaic when compiled for a TPU, the
interpreter otherwise (`compile_platform`); 16-bit hidden states keep their
dtype in the matmuls, float32 accumulation; JAX version shims use `getattr`.

The tile and VMEM rule (docs/tpu.md, "Scoped VMEM"): tiles are multiples of
128; a pass's estimate fits 7/8 of the scoped VMEM it asks for (at most 3/4 of
the chip's, else 16 MiB); the tiles take 3/4 of that budget, resident rows the
rest (at most a quarter). Pallas has its own rule beside
`keras_cutbce.math.tiling`: its tiles must fit VMEM and be 128-aligned.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from keras_cutbce.backends.jax import compile_platform, vjp
from keras_cutbce.backends.jax.pallas import kernel
from keras_cutbce.backends.jax.pallas.kernel import LANES, PIECE_COLS
from keras_cutbce.common import EMPTY_ID, round_up
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets

# -- The static settings of a call, the tile and VMEM rule --------------------------

MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_TILE = 4096  # 32 hit bits x 128 lanes (`kernel._fill_hit_bits`)
TILE_STEP = 256  # tile widths below the widest: whole 256-wide piece columns
PIECE_ROWS = 64  # a piece of a step's tile: 64 rows (float32 [64, 256]: 16 vector registers)
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20  # the compiler's limit when a kernel asks for none


class Config(NamedTuple):
    """Static (hashable) settings of one call, the same for all its passes (docs/tpu.md)."""

    vocab_size: int  # V
    family: object  # the loss family in the kernel: `kernel.BCE` or `kernel.Softmax`
    row_tile: int  # rows of one kernel step (a multiple of 128)
    tile: int  # items of one vocabulary tile (a multiple of 128)
    num_ids: int  # L
    mm_dtype: str  # the matmul operands' dtype
    interpret: object  # True, False, or None: decided by the compilation target
    vmem_capacity: object  # VMEM bytes per TensorCore, None: unknown
    precision: object  # `lax.Precision` of float32 matmuls (None: default)
    table_dtype: str  # dtype of the table gradient the kernels write
    dv_view: bool  # the table read as its `[D, V]` view (D % 128 != 0)
    cores: int = 1  # TensorCores the vocabulary is split across
    newton_reciprocal: bool = False  # BCE's `1 / u` as the approximate reciprocal and one Newton step
    # The plan of the passes (`plan`): tiles, the cores used, a step's pieces, and
    # per pass kind (loss only, with gradients) its resident row blocks and scoped VMEM.
    num_tiles: int = 0
    active_cores: int = 1
    piece: tuple = ()  # `(rows, cols)` of a piece of a step's tile (`piece_shape`)
    blocks: tuple = ()  # `(count, block_rows)` without, then with gradients
    vmem_limits: tuple = ()  # the VMEM a pass asks for (None: the default), likewise


def vmem_capacity_bytes():
    """Returns the VMEM bytes of one TensorCore of the target TPU, or None when unknown."""
    chip = compile_platform.compiled_chip()
    return None if chip is None else chip.vmem_bytes


def newton_reciprocal():
    """Whether the target divides by a reciprocal op and a Newton step (`kernel.Exps`): v4, v5e, v5p."""
    chip = compile_platform.compiled_chip()
    return chip is not None and not chip.reciprocal_divides


def tensorcores():
    """Returns the TensorCores one device of the target TPU drives (2 on v4 and v5p), else 1."""
    chip = compile_platform.compiled_chip()
    return 1 if chip is None else chip.cores


def vmem_limit_bytes(capacity=None):
    """Returns the scoped VMEM a pass compiles under: 3/4 of `capacity`, else the 16 MiB default."""
    return DEFAULT_SCOPED_VMEM_BYTES if capacity is None else capacity * 3 // 4


def vmem_budget_bytes(capacity=None):
    """Returns what a pass's estimated VMEM may total: 7/8 of its limit (`vmem_limit_bytes`)."""
    return vmem_limit_bytes(capacity) * 7 // 8


def tile_budget_bytes(capacity=None):
    """Returns the tiles' share of the budget (`footprint_bytes`): three quarters."""
    return vmem_budget_bytes(capacity) * 3 // 4


def footprint_bytes(row_tile, tile, dim, itemsize, table_itemsize=None):
    """Returns the estimated VMEM bytes of one kernel step (windows, scratch, one `[row_tile, tile]` of spills)."""
    table_itemsize = itemsize if table_itemsize is None else table_itemsize
    windows = 3 * 2 * tile * (dim * table_itemsize + 4)  # tiles, gradients, carried
    accumulator = 0 if table_itemsize == 4 else tile * dim * 4
    scratch = row_tile * (2 * PIECE_COLS * (itemsize + 4) + 6 * LANES * 4
                          + 2 * max(dim, LANES) * itemsize)
    spills = row_tile * tile * 4
    return windows + accumulator + scratch + spills


def vmem_request_bytes(capacity, footprint, resident):
    """Returns the `vmem_limit_bytes` a kernel asks for: 1.5 x its estimate + 4 MiB, capped."""
    return int(min(vmem_limit_bytes(capacity), 3 * (footprint + resident) // 2 + 4 * 2**20))


def choose_tiles(num_rows, vocab_size, dim, dtype, budget_bytes=None, table_dtype=None):
    """Returns `(row_tile, tile)`: the largest step within the budget, ties to the wider tile.

    >>> choose_tiles(130, 1000, 64, "float32", budget_bytes=16 * 2**20)
    (256, 1024)
    """
    if budget_bytes is None:
        budget_bytes = tile_budget_bytes(vmem_capacity_bytes())
    itemsize = jnp.dtype(dtype).itemsize
    table_itemsize = jnp.dtype(table_dtype or dtype).itemsize
    tallest = min(MAX_ROW_TILE, round_up(max(num_rows, 1), LANES))
    widest = min(MAX_TILE, round_up(max(vocab_size, 1), LANES))
    widths = [widest] + list(range(widest // TILE_STEP * TILE_STEP, 0, -TILE_STEP))
    fits = [(row_tile * tile, tile, row_tile)
            for row_tile in [tallest] + [r for r in (256, MIN_ROW_TILE) if r < tallest]
            for tile in widths
            if footprint_bytes(row_tile, tile, dim, itemsize, table_itemsize) <= budget_bytes]
    if not fits:
        return min(tallest, MIN_ROW_TILE), LANES
    _, tile, row_tile = max(fits)
    return row_tile, tile


def num_tiles(cfg):
    """Returns the number of vocabulary tiles (the last one may be partial)."""
    return pl.cdiv(cfg.vocab_size, cfg.tile)


def cores_used(cfg):
    """Returns the TensorCores the vocabulary is split across (each gets at least one tile)."""
    return max(1, min(cfg.cores, num_tiles(cfg)))


def resident_bytes_per_row(dim, num_ids, hidden_itemsize, with_grads):
    """Returns the VMEM bytes a resident row costs a pass (one buffer, sublane-padded)."""
    per_row = round_up(dim, 16) * hidden_itemsize + round_up(num_ids, 8) * 4 + 8 * 4
    if with_grads:
        per_row += 8 * 4 + round_up(dim, 8) * 4  # row_scale, hidden gradient
    return per_row


def config_footprint_bytes(cfg, dim):
    """Returns `footprint_bytes` of a call's tiles and dtypes (`Config`)."""
    return footprint_bytes(cfg.row_tile, cfg.tile, dim, jnp.dtype(cfg.mm_dtype).itemsize,
                           jnp.dtype(cfg.table_dtype).itemsize)


def resident_budget_bytes(cfg, dim):
    """Returns the resident rows' VMEM: what the budget leaves the tiles, at most a quarter."""
    budget = vmem_budget_bytes(cfg.vmem_capacity)
    return max(0, min(budget // 4, budget - config_footprint_bytes(cfg, dim)))


def rows_per_pass(cfg, dim, hidden_itemsize, with_grads=True):
    """Returns the most rows one pass holds resident (a multiple of the row tile, at least one)."""
    per_row = resident_bytes_per_row(dim, cfg.num_ids, hidden_itemsize, with_grads)
    rows = resident_budget_bytes(cfg, dim) // per_row // cfg.row_tile * cfg.row_tile
    return max(cfg.row_tile, rows)


def row_blocks(num_rows, dim, hidden_itemsize, cfg, with_grads=True):
    """Returns `(count, block_rows)`: the resident row blocks, one pass over the table each."""
    padded = round_up(max(num_rows, 1), cfg.row_tile)
    count = pl.cdiv(padded, rows_per_pass(cfg, dim, hidden_itemsize, with_grads))
    return count, round_up(pl.cdiv(padded, count), cfg.row_tile)


def vmem_limit(cfg, block_rows, dim, hidden_itemsize, with_grads):
    """Returns the VMEM a pass asks for (`vmem_request_bytes`), or None: the default."""
    if cfg.vmem_capacity is None:
        return None
    resident = block_rows * resident_bytes_per_row(dim, cfg.num_ids, hidden_itemsize, with_grads)
    return vmem_request_bytes(cfg.vmem_capacity, config_footprint_bytes(cfg, dim), resident)


def piece_shape(cfg):
    """Returns `(rows, cols)` of one piece of a grid step's tile (a few vector registers each)."""
    cols = next(c for c in (cfg.family.piece_cols, 256, LANES) if cfg.tile % c == 0)
    return min(PIECE_ROWS, cfg.row_tile), cols


def plan(cfg, num_rows, dim, hidden_itemsize):
    """Returns `cfg` with its passes planned: tiles, cores, pieces, row blocks and VMEM per pass kind."""
    cfg = cfg._replace(num_tiles=num_tiles(cfg), active_cores=cores_used(cfg),
                       piece=piece_shape(cfg))
    blocks = tuple(row_blocks(num_rows, dim, hidden_itemsize, cfg, with_grads)
                   for with_grads in (False, True))
    limits = tuple(vmem_limit(cfg, block_rows, dim, hidden_itemsize, with_grads)
                   for with_grads, (_, block_rows) in zip((False, True), blocks))
    return cfg._replace(blocks=blocks, vmem_limits=limits)


# -- The entry points ------------------------------------------------------------

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


def sorted_positives(ids, vocab_size):
    """Returns `(sorted, keep)`: each row's valid distinct ids ascending, `EMPTY_ID` first for the rest.

    `keep`: which of the given ids count (`keras_cutbce.math.positives.distinct_targets`).
    """
    safe, keep = distinct_targets(ids, vocab_size)
    return jnp.sort(jnp.where(keep, safe, EMPTY_ID), axis=1), keep


def prepare(hidden, table, ids, bias, family, chunk_size, block_rows, interpret,
            precision="default"):
    """Returns `(cfg, hidden, table, bias, (ids, keep))`: the call's planned `Config` and its arrays.

    `family`: the kernel's loss family; `(ids, keep)`: `sorted_positives`.
    """
    if precision not in _PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {sorted(_PRECISIONS)}. Received: precision={precision!r}"
        )
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    bias = None if bias is None else jnp.asarray(bias)
    ids = jnp.asarray(ids)
    assert ids.ndim == 2, ids.shape
    num_rows, dim = hidden.shape
    vocab_size = table.shape[0]
    mm_dtype = _matmul_dtype(hidden, table)
    if ids.shape[1] == 0:  # No positives: one padding id keeps shapes non-empty.
        ids = jnp.full((num_rows, 1), EMPTY_ID, jnp.int32)
    ids, keep = sorted_positives(ids, vocab_size)
    capacity = vmem_capacity_bytes()
    rows_tile, tile = choose_tiles(num_rows, vocab_size, dim, mm_dtype,
                                   tile_budget_bytes(capacity), table.dtype)
    if chunk_size is not None:
        tile = min(round_up(chunk_size, LANES), round_up(vocab_size, LANES), MAX_TILE)
    if block_rows is not None:
        rows_tile = min(round_up(block_rows, LANES), round_up(max(num_rows, 1), LANES))
    cfg = Config(
        vocab_size=int(vocab_size),
        family=family,
        row_tile=int(rows_tile),
        tile=int(tile),
        num_ids=int(ids.shape[1]),
        mm_dtype=mm_dtype,
        interpret=_resolve_interpret(interpret),
        vmem_capacity=capacity,
        precision=_PRECISIONS[precision],
        table_dtype=jnp.dtype(table.dtype).name,
        dv_view=dim % LANES != 0,
        cores=int(tensorcores()),
        newton_reciprocal=newton_reciprocal(),
    )
    cfg = plan(cfg, num_rows, dim, hidden.dtype.itemsize)
    return cfg, hidden, table, bias, (ids, keep)


def bce_family(label_smoothing, pos_weight):
    return kernel.BCE(bce_coefficients(label_smoothing, pos_weight))


def softmax_family(label_smoothing, vocab_size, positives=True):
    return kernel.Softmax(float(label_smoothing), int(vocab_size), positives)


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0,
            chunk_size=None, block_rows=None, interpret=None, precision="default"):
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
        hidden, table, ids, bias, bce_family(label_smoothing, pos_weight), chunk_size, block_rows,
        interpret, precision)
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return functions(cfg)[0](hidden, table, ids, bias)


def cut_bce_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing=0.0,
                         pos_weight=1.0, chunk_size=None, block_rows=None, interpret=None,
                         precision="default"):
    """`sum_m row_weights[m] * cut_bce(...)[m]`; loss and gradients in one kernel pass."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, bce_family(label_smoothing, pos_weight), chunk_size, block_rows,
        interpret, precision)
    row_weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return functions(cfg)[1](hidden, table, ids, bias, row_weights)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None,
                block_rows=None, interpret=None, precision="default"):
    """`cut_bce` for the softmax cross-entropy (`kernel.Softmax`), float32 `[M]`."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, softmax_family(label_smoothing, table.shape[0]), chunk_size,
        block_rows, interpret, precision)
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return functions(cfg)[0](hidden, table, ids, bias)


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing=0.0,
                             chunk_size=None, block_rows=None, interpret=None,
                             precision="default"):
    """`cut_bce_weighted_sum` for softmax: a statistics pass, then the gradient pass."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, softmax_family(label_smoothing, table.shape[0]), chunk_size,
        block_rows, interpret, precision)
    row_weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return functions(cfg)[1](hidden, table, ids, bias, row_weights)


def softmax_statistics(hidden, table, bias, *, chunk_size=None, interpret=None):
    """Returns the rows' `(max, sum_v exp(z_v - max))`, float32 `[M]` each (no gradient)."""
    cfg, hidden, table, bias, (ids, _) = prepare(
        hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
        softmax_family(0.0, table.shape[0], positives=False), chunk_size, None, interpret)
    return passes(hidden, table, bias, ids, None, cfg, with_loss=True)[0]


def softmax_gradients(hidden, table, bias, lse, row_scale, *, chunk_size=None, interpret=None):
    """Returns the float32 gradients of `sum_m row_scale_m sum_v exp(z_mv - lse_m)` (no smoothing)."""
    cfg, hidden, table, bias, (ids, _) = prepare(
        hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
        softmax_family(0.0, table.shape[0], positives=False), chunk_size, None, interpret)
    grads = passes(hidden, table, bias, ids, row_scale, cfg, with_loss=False,
                        slope_inputs=(lse,))[1]
    return grads[0], grads[1].astype(jnp.float32), grads[2]


# -- A family's loss and gradients -----------------------------------------------------


@functools.lru_cache(maxsize=128)
def functions(cfg):
    """Returns the differentiable `(per_row_loss, weighted_sum)` of one configuration."""

    def loss_fn(hidden, table, ids, bias):
        return loss_and_grads(hidden, table, ids, bias, cfg, loss=True)[0]

    def grads_fn(hidden, table, ids, bias, row_weights):
        return loss_and_grads(hidden, table, ids, bias, cfg, loss=False,
                              row_weights=row_weights)[1]

    def loss_and_grads_fn(hidden, table, ids, bias, row_weights):
        return loss_and_grads(hidden, table, ids, bias, cfg, loss=True, row_weights=row_weights)

    return (vjp.per_row_loss(loss_fn, grads_fn),
            vjp.weighted_sum(loss_fn, loss_and_grads_fn))


def loss_and_grads(hidden, table, ids, bias, cfg, *, loss, row_weights=None):
    """The rows' loss `[M]` (or None) and the gradients of `sum_m row_weights_m loss_m` (or None).

    `ids`: `(sorted positives, keep)` (`prepare`). A one-pass family's
    kernel gives the loss and the slopes in one pass; a two-pass family's
    statistics pass gives `statistics` (softmax: the log-sum-exp), which the
    gradient pass takes with each row's positive slope at its hit bits. The
    kernel's row outputs, then the rows' `sum_v z_v` (`logit_sums`, exact in
    closed form), are the backend family's reduction `acc`; the positives'
    logit sums come from the last pass (no gather or scatter over the table).
    """
    ids, keep = ids
    family, vocab = cfg.family.xla, cfg.vocab_size
    scale = None if row_weights is None else family.row_scale(row_weights, keep, vocab)[0]
    if not family.two_pass:
        acc, grads = passes(hidden, table, bias, ids, scale, cfg, with_loss=loss)
        return (family.finish(acc[0], None, keep, vocab) if loss else None), grads
    stats, _ = passes(hidden, table, bias, ids, None, cfg, with_loss=True,
                      positive_sums=loss and scale is None)
    # Each row's positive slope, -(1 - a) / |P|: its positives' loss is `weight * sum z_p`.
    weight = family.positives(stats[0][:, None], keep, loss=False, grad=True)[1][:, 0]
    grads = None
    if scale is not None:
        sums, grads = passes(hidden, table, bias, ids, scale, cfg, with_loss=False,
                             slope_inputs=(family.statistics(stats), weight),
                             positive_sums=loss)
        stats += sums
        grads = (grads[0], grads[1].astype(jnp.float32), grads[2])
    if not loss:
        return None, grads
    *acc, positive_sums = stats
    total = jnp.zeros_like(positive_sums)
    if cfg.family.logit_sums:
        total = jnp.matmul(hidden.astype(jnp.float32), jnp.sum(table.astype(jnp.float32), axis=0),
                           precision=lax.Precision.HIGHEST)
        total = total if bias is None else total + jnp.sum(bias.astype(jnp.float32))
    return family.finish((*acc, total), weight * positive_sums, keep, vocab), grads


# -- The passes: rows laid out, one `pallas_call` per resident row block ---------------

MAX_PREFETCHED_COUNTS = 2**14  # in-tile id counts kept per row tile up to 64 KiB of SMEM
# The TPU interpreter mishandles aliased outputs with a partial last block
# (JAX 0.10.2), so interpreted passes copy the carried gradients instead;
# a test turns aliasing on at shapes whose blocks are all full.
INTERPRET_ALIASES = False
_SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None


class Pass(NamedTuple):
    """Static shape of one pass over the table for one block of resident rows."""

    has_bias: bool
    with_loss: bool  # writes the family's row outputs (BCE: loss sums; softmax: max and sum exp)
    with_grads: bool  # writes the gradients, rows weighted by `row_scale`
    carry: bool  # the table and bias gradients add to earlier blocks' (aliased)
    block_rows: int  # resident rows of this pass
    tiles_per_core: int
    counts_per_row_tile: bool  # in-tile id counts per (tile, row tile), else per tile
    positive_sums: bool = False  # softmax: writes the sums of the rows' positives' logits
    hit_bits: bool = True  # the kernel finds the rows' ids in its tiles (`family.finds_positives`)
    bias_rows: int = 0  # the bias's rows in the `[D, V]` view's matmuls (0: added on the VPU)


def bias_rows(cfg, has_bias):
    """Returns the rows the bias adds to the `[D, V]` view's matmuls (0: added on the VPU).

    In the `[D, V]` view the bias rides the MXU: `kernel.BIAS_PARTS` rows of
    the table piece (its bfloat16-exact parts) against ones columns of the
    hidden states, and the row scale's parts as rows of the scaled hidden states
    give the bias gradient; a whole packed sublane tile of rows (8 float32, 16 bfloat16).
    """
    return 32 // jnp.dtype(cfg.mm_dtype).itemsize if has_bias and cfg.dv_view else 0


def passes(hidden, table, bias, ids, row_scale, cfg, with_loss, slope_inputs=(),
           positive_sums=False):
    """Returns the family's row outputs `([M], ...)` (`()` without), and the gradients or None.

    The row outputs: the family's `init` (BCE: the loss sums; softmax: `(max,
    sum exp)`), then the sums of the positives' logits with `positive_sums`.
    The gradients are those of `sum_m row_scale_m loss_m` (softmax: of its
    slopes given `slope_inputs`, its `(lse, weight)`); one pass over the
    table per resident row block.
    """
    with_grads = row_scale is not None
    count, block_rows = cfg.blocks[with_grads]
    padded = count * block_rows
    ps = Pass(bias is not None, with_loss, with_grads, False, block_rows,
              pl.cdiv(cfg.num_tiles, cfg.active_cores), True, positive_sums,
              bias_rows=bias_rows(cfg, bias is not None))
    ps = ps._replace(hit_bits=cfg.family.finds_positives(ps))
    hidden_p, ids_p, row_scale_p = row_inputs(hidden, ids if ps.hit_bits else None, row_scale,
                                              padded, cfg)
    slope_inputs = [_pad_rows(x.astype(jnp.float32), padded, pad)[None, :]
                    for x, (_, pad) in zip(slope_inputs, cfg.family.slope_inputs(ps))]
    if ps.hit_bits:
        counts = in_tile_counts(ids_p, cfg)
    else:  # no ids in the tiles: the prefetched counts are a placeholder
        counts = jnp.zeros((cfg.num_tiles, padded // cfg.row_tile), jnp.int32)
    row_tiles = block_rows // cfg.row_tile
    per_row_tile = counts.shape[0] * row_tiles <= MAX_PREFETCHED_COUNTS
    losses, hidden_grads, carried = [], [], None
    for block in range(count):
        ps = ps._replace(carry=carried is not None, counts_per_row_tile=per_row_tile)
        block_counts = counts[:, block * row_tiles : (block + 1) * row_tiles]
        block_counts = block_counts.reshape(-1) if per_row_tile else block_counts.max(axis=1)
        stats, grad_hidden, grad_table, grad_bias = _pass(
            hidden_p, table, bias, ids_p, row_scale_p, block_counts, carried, block, ps, cfg,
            slope_inputs)
        losses.append(stats)
        hidden_grads.append(grad_hidden)
        if with_grads:
            carried = (grad_table,) + (() if bias is None else (grad_bias,))
    num_rows = hidden.shape[0]
    stats = tuple(jnp.concatenate(parts)[:num_rows] for parts in zip(*losses))
    if not with_grads:
        return stats, None
    if cfg.dv_view:
        grad_hidden = jnp.concatenate(hidden_grads, axis=1).T[:num_rows]
    else:
        grad_hidden = jnp.concatenate(hidden_grads, axis=0)[:num_rows]
    grad_bias = None if bias is None else carried[1][0]
    grad_table = carried[0].T if cfg.dv_view else carried[0]
    return stats, (grad_hidden, grad_table, grad_bias)


def _pad_rows(x, rows, value=0):
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=value)


def row_inputs(hidden, ids, row_scale, rows, cfg):
    """Returns the padded rows in the kernel's layout: hidden, the sorted positives `[L, rows]`, `row_scale`."""
    hidden = _pad_rows(hidden, rows)
    hidden = hidden.T if cfg.dv_view else hidden
    if ids is not None:
        ids = _pad_rows(ids, rows, EMPTY_ID).T
    if row_scale is not None:
        row_scale = _pad_rows(row_scale.astype(jnp.float32), rows)[None, :]
    return hidden, ids, row_scale


def in_tile_counts(ids_t, cfg):
    """Returns `[tiles, row tiles]` int32: the most positives one row of a row tile has in a tile."""
    ids = ids_t.T
    rows, length = ids.shape
    tiles = cfg.num_tiles
    tile_of = jnp.where(ids >= 0, ids // cfg.tile, tiles)  # EMPTY_ID: dropped
    slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    starts = jnp.concatenate(
        [jnp.ones((rows, 1), bool), tile_of[:, 1:] != tile_of[:, :-1]], axis=1)
    rank = slot - lax.cummax(jnp.where(starts, slot, 0), axis=1)
    row_tile = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) // cfg.row_tile)[:, None],
                                ids.shape)
    counts = jnp.zeros((tiles, rows // cfg.row_tile), jnp.int32)
    return counts.at[tile_of, row_tile].max(rank + 1, mode="drop")


def _pass(hidden, table, bias, ids, row_scale, counts, carried, block, ps, cfg, slope_inputs):
    """Runs one `pallas_call`: row block `block` against the whole table.

    Returns `(row outputs, grad_hidden | None, grad_table | None, grad_bias |
    None)`; the row outputs as `passes` gives them.
    """
    family, dim = cfg.family, table.shape[1]
    tile, block_rows, per_core = cfg.tile, ps.block_rows, ps.tiles_per_core
    tiles, cores = cfg.num_tiles, cfg.active_cores
    grid = (cores, per_core, block_rows // cfg.row_tile)
    # The call's settings: compiled (the pass's scoped VMEM) or interpreted.
    semantics = ("parallel", "arbitrary", "arbitrary")
    params = {False: _compiler_params(semantics, cfg.vmem_limits[ps.with_grads]),
              True: _compiler_params(semantics, None)}
    interpreter = interpret_arg(True) if cfg.interpret else False
    cost = _cost(cfg, block_rows, dim, table.dtype.itemsize, ps)

    def tile_of(core, j):
        return j if cores == 1 else jnp.minimum(core * per_core + j, tiles - 1)

    def table_spec():
        if cfg.dv_view:
            return pl.BlockSpec((dim, tile), lambda c, j, i, *_: (0, tile_of(c, j)))
        return pl.BlockSpec((tile, dim), lambda c, j, i, *_: (tile_of(c, j), 0))

    bias_spec = pl.BlockSpec((1, tile), lambda c, j, i, *_: (0, tile_of(c, j)))
    hidden_block = (dim, block_rows) if cfg.dv_view else (block_rows, dim)
    row_spec = pl.BlockSpec((1, block_rows), lambda c, j, i, *_: (0, block))
    # (name, spec, array) of each input, output and scratch, in the kernel's order.
    inputs = [("hidden", pl.BlockSpec(hidden_block, (lambda c, j, i, *_: (0, block))
                                      if cfg.dv_view else (lambda c, j, i, *_: (block, 0))),
               hidden)]
    if ps.hit_bits:
        inputs.append(("ids", pl.BlockSpec((ids.shape[0], block_rows),
                                           lambda c, j, i, *_: (0, block)), ids))
    if ps.with_grads:
        inputs.append(("row_scale", row_spec, row_scale))
    inputs += [(name, row_spec, x) for (name, _), x in zip(family.slope_inputs(ps), slope_inputs)]
    inputs.append(("table", table_spec(), table.T if cfg.dv_view else table))
    if ps.has_bias:
        inputs.append(("bias", bias_spec, bias.astype(jnp.float32).reshape(1, -1)))
    if ps.carry:
        inputs.append(("carried_table", table_spec(), carried[0]))
        if ps.has_bias:
            inputs.append(("carried_bias", bias_spec, carried[1]))
    row_out = (pl.BlockSpec((_SQUEEZED, 1, block_rows), lambda c, j, i, *_: (c, 0, 0)),
               jax.ShapeDtypeStruct((cores, 1, block_rows), jnp.float32))
    outputs = [(name,) + row_out for name, _ in family.init(ps)]
    in_place = jnp.dtype(cfg.table_dtype) == jnp.float32  # else a float32 scratch
    scratch = []
    if ps.with_grads:
        view = (dim, cfg.vocab_size) if cfg.dv_view else (cfg.vocab_size, dim)
        outputs += [
            ("grad_hidden", pl.BlockSpec((_SQUEEZED,) + hidden_block, lambda c, j, i, *_: (c, 0, 0)),
             jax.ShapeDtypeStruct((cores,) + hidden_block, jnp.float32)),
            ("grad_table", table_spec(), jax.ShapeDtypeStruct(view, cfg.table_dtype))]
        if ps.has_bias:
            outputs.append(("grad_bias", bias_spec,
                            jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32)))
        if not in_place:
            scratch.append(("acc_table", pltpu.VMEM((dim, tile) if cfg.dv_view else (tile, dim),
                                                    jnp.float32)))
    scratch += _scratch(cfg, ps, dim, jnp.dtype(cfg.mm_dtype))
    aliases = {}
    if ps.carry:  # accumulate in place: the carried buffers are the outputs
        names = [name for name, *_ in inputs]
        first_out = [name for name, *_ in outputs].index("grad_table")
        carry_in = 1 + names.index("carried_table")  # operand 0: the prefetched counts
        aliases = {carry_in + k: first_out + k for k in range(len(carried))}
    names = tuple(["in_tile"] + [x[0] for x in inputs + outputs + scratch])

    def build(interpret, plain=False):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=[x[1] for x in inputs],
            out_specs=[x[1] for x in outputs], scratch_shapes=[x[1] for x in scratch])
        return pl.pallas_call(
            functools.partial(kernel.kernel, cfg=cfg, ps=ps, names=names,
                              interpreted=bool(plain or interpret)),
            grid_spec=grid_spec,
            out_shape=[x[2] for x in outputs],
            # Without aliasing (interpreted) the numbers are the same, only
            # the carried buffers are not reused (`INTERPRET_ALIASES`).
            input_output_aliases=aliases if not interpret or INTERPRET_ALIASES else {},
            compiler_params=params[bool(interpret)],
            interpret=True if plain else (interpreter if interpret else False),
            cost_estimate=cost,
            name=family.kernel_name(ps),
        )

    operands = (counts,) + tuple(x[2] for x in inputs)
    if cfg.interpret is None:  # target unknown at trace time: decided at lowering
        # The plain (effect-free) interpreter: `platform_dependent` cannot drop
        # the ordered effects of `pltpu.InterpretParams`'s callbacks.
        outs = compile_platform.by_platform(operands, build(False), build(True, plain=True))
    else:
        outs = build(cfg.interpret)(*operands)
    stats = len(family.init(ps))
    outs = list(outs)
    loss = family.merge_cores(outs[:stats], ps)
    if not ps.with_grads:
        return loss, None, None, None
    # The kernel's hidden gradient is before the row scale (`kernel`).
    scale = row_scale[:, block * block_rows:(block + 1) * block_rows]
    grad_hidden = outs[stats].sum(axis=0) * (scale if cfg.dv_view else scale.T)
    return loss, grad_hidden, outs[stats + 1], (outs[stats + 2] if ps.has_bias else None)


def _scratch(cfg, ps, dim, mm_dtype):
    """Returns `(name, VMEM shape)` of the kernel's scratch after the table accumulator, in order."""
    column = pltpu.VMEM((cfg.row_tile, LANES), jnp.float32)
    extra = ps.bias_rows
    cols = cfg.piece[1]
    shapes = []
    if ps.with_grads:
        shapes.append(("scaled", pltpu.VMEM((dim + extra, cfg.row_tile) if cfg.dv_view
                                            else (cfg.row_tile, dim), mm_dtype)))
        shapes += [(f"slopes_{k}", pltpu.VMEM((cfg.row_tile, cols), mm_dtype)) for k in (0, 1)]
    shapes += [(name, column) for name, _ in cfg.family.lanes(cfg, ps)]
    if ps.hit_bits:
        shapes += [("bits", pltpu.VMEM((cfg.row_tile, LANES), jnp.int32)),
                   ("bits_t", pltpu.VMEM((LANES, cfg.row_tile), jnp.int32))]
    if ps.with_grads and not cfg.dv_view:  # the row scale as a column: rows, VPU bias gradient
        shapes.append(("scale_col", column))
    shapes += [(name + "_col", column) for name, _ in cfg.family.slope_inputs(ps)]
    if cfg.dv_view:
        shapes.append(("hidden_t", pltpu.VMEM((cfg.row_tile, dim + extra), mm_dtype)))
    if extra:
        shapes.append(("bias_parts", pltpu.VMEM((extra, cfg.tile), mm_dtype)))
    shapes += [(f"logits_{k}", pltpu.VMEM((cfg.row_tile, cols), jnp.float32)) for k in (0, 1)]
    return shapes


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


def _compiler_params(semantics, vmem_limit):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    kwargs = dict(dimension_semantics=semantics)
    if vmem_limit is not None:
        kwargs["vmem_limit_bytes"] = int(vmem_limit)
    return cls(**kwargs)


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
