"""The Pallas entry points (contract: `registry`): a call's arrays and static settings, then `call`.

`prepare` checks and normalises the arrays, de-duplicates and sorts each row's
ids once, and builds the call's static `Config` with its loss family
(`kernel.BCE`, `kernel.Softmax`) and its plan: tiles, TensorCores, resident
row blocks and scoped VMEM per pass kind.

The tile and VMEM rule (docs/tpu.md, "Scoped VMEM"): tiles are multiples of
128; a pass's estimate fits 7/8 of the scoped VMEM it asks for (at most 3/4 of
the chip's, else 16 MiB); the tiles take 3/4 of that budget, resident rows the
rest (at most a quarter). Pallas has its own rule beside
`keras_cutbce.math.tiling`: its tiles must fit VMEM and be 128-aligned.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import compile_platform
from keras_cutbce.backends.jax.pallas import call, kernel
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
    return call.functions(cfg)[0](hidden, table, ids, bias)


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
    return call.functions(cfg)[1](hidden, table, ids, bias, row_weights)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None,
                block_rows=None, interpret=None, precision="default"):
    """`cut_bce` for the softmax cross-entropy (`kernel.Softmax`), float32 `[M]`."""
    cfg, hidden, table, bias, ids = prepare(
        hidden, table, ids, bias, softmax_family(label_smoothing, table.shape[0]), chunk_size,
        block_rows, interpret, precision)
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return call.functions(cfg)[0](hidden, table, ids, bias)


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
    return call.functions(cfg)[1](hidden, table, ids, bias, row_weights)


def softmax_statistics(hidden, table, bias, *, chunk_size=None, interpret=None):
    """Returns the rows' `(max, sum_v exp(z_v - max))`, float32 `[M]` each (no gradient)."""
    cfg, hidden, table, bias, (ids, _) = prepare(
        hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
        softmax_family(0.0, table.shape[0], positives=False), chunk_size, None, interpret)
    return call.passes(hidden, table, bias, ids, None, cfg, with_loss=True)[0]


def softmax_gradients(hidden, table, bias, lse, row_scale, *, chunk_size=None, interpret=None):
    """Returns the float32 gradients of `sum_m row_scale_m sum_v exp(z_mv - lse_m)` (no smoothing)."""
    cfg, hidden, table, bias, (ids, _) = prepare(
        hidden, table, jnp.zeros((hidden.shape[0], 0)), bias,
        softmax_family(0.0, table.shape[0], positives=False), chunk_size, None, interpret)
    grads = call.passes(hidden, table, bias, ids, row_scale, cfg, with_loss=False,
                        slope_inputs=(lse,))[1]
    return grads[0], grads[1].astype(jnp.float32), grads[2]
