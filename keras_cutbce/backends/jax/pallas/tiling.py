"""The tile and VMEM rule of the Pallas kernels.

The chunked kernels take their tile from `keras_cutbce.math.tiling` (a
budget for a few `[rows, tile]` float32 intermediates in cache or memory).
Pallas needs its own rule, because its tiles must fit VMEM, not a cache,
and Mosaic adds constraints XLA does not have:

- both tiles are multiples of 128 (MXU- and lane-aligned, and a multiple of
  the 8/16 sublanes of float32/bfloat16);
- a pass compiles under a scoped VMEM limit: the one it asks for, at most
  three quarters of the target TPU's VMEM per TensorCore
  (`compile_platform.chip_info`; the rest stays XLA's), or, for an unknown
  generation, the compiler's default, 16 MiB on v4, v5e and v5p
  (`vmem_limit_bytes`). Its estimated VMEM (`footprint_bytes` plus the
  resident rows) totals at most 7/8 of that limit (`vmem_budget_bytes`), and
  it asks for its estimate with headroom (`vmem_request_bytes`);
- the tiles take at most three quarters of the budget (`tile_budget_bytes`):
  the largest step (`row_tile x tile`), ties to the wider tile, with
  `row_tile` `M` rounded up to 128 (at most 512), 256 or 128, and `tile`
  a multiple of 256 (pieces at least 256 wide) up to 4096 and `V` rounded up
  to 128, or that width itself (`choose_tiles`); nothing fits: 128 x 128;
- the resident rows of one pass (hidden states, ids, weights, loss and
  hidden gradient, one buffer each) take the rest, at most a quarter of the
  budget; more rows run one pass per row block (`row_blocks`).
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import compile_platform
from keras_cutbce.common import round_up

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_TILE = 4096  # 32 hit bits x 128 lanes (`kernel._fill_hit_bits`)
TILE_STEP = 256  # tile widths below the widest: whole 256-wide piece columns
PIECE_ROWS = 64  # a piece of a step's tile: [64, 512] float32, 32 vector registers
PIECE_COLS = 512
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20  # the compiler's limit when a kernel asks for none


def vmem_capacity_bytes():
    """Returns the VMEM bytes of one TensorCore of the target TPU, or None when unknown."""
    chip = compile_platform.compiled_chip()
    return None if chip is None else chip.vmem_bytes


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
    """Returns the estimated VMEM bytes of one kernel step with these tiles.

    Double-buffered, in the table's dtype (`table_itemsize`, default
    `itemsize`): the table and bias tiles, their gradients, and the carried
    gradients of a pass after the first; a float32 accumulator of a 16-bit
    table's gradient; the step's scratch: two slope buffers (`itemsize`, the
    matmul dtype) and two float32 logits buffers of one piece column, the
    `[row_tile, 128]` loss, hit-bit and scale columns (and the pass building
    the hit bits), the hidden states transposed and scaled; and what Mosaic
    spills of the unrolled step, counted as one float32 `[row_tile, tile]`
    (libtpu 0.0.42's VMEM report: 0.1 to 1.06 of it).
    """
    table_itemsize = itemsize if table_itemsize is None else table_itemsize
    windows = 3 * 2 * tile * (dim * table_itemsize + 4)  # tiles, gradients, carried
    accumulator = 0 if table_itemsize == 4 else tile * dim * 4
    scratch = row_tile * (2 * PIECE_COLS * (itemsize + 4) + 6 * LANES * 4
                          + 2 * max(dim, LANES) * itemsize)
    spills = row_tile * tile * 4
    return windows + accumulator + scratch + spills


def vmem_request_bytes(capacity, footprint, resident):
    """Returns the `vmem_limit_bytes` a kernel asks for: its estimate with headroom, capped.

    1.5 x (`footprint` + `resident` rows) + 4 MiB for Mosaic's own scratch,
    at most `vmem_limit_bytes(capacity)`.
    """
    return int(min(vmem_limit_bytes(capacity), 3 * (footprint + resident) // 2 + 4 * 2**20))


def choose_tiles(num_rows, vocab_size, dim, dtype, budget_bytes=None, table_dtype=None):
    """Returns `(row_tile, tile)` for the kernels (the module's rule).

    `dtype`: the matmul dtype; `table_dtype`: the table's (default `dtype`);
    `budget_bytes`: the tiles' budget (default: `tile_budget_bytes` of the
    target).

    Example:

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
    """Returns the VMEM bytes a resident row costs a pass (sublane-padded).

    One buffer: a resident block's index is the same at every grid step, and
    the compiler keeps a single buffer of it (libtpu's VMEM report).
    """
    per_row = round_up(dim, 16) * hidden_itemsize + round_up(num_ids, 8) * 4 + 8 * 4
    if with_grads:
        per_row += 8 * 4 + round_up(dim, 8) * 4  # row_scale, hidden gradient
    return per_row


def config_footprint_bytes(cfg, dim):
    """Returns `footprint_bytes` of a call's tiles and dtypes (`config.Config`)."""
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
    """Returns `(count, block_rows)`: the resident row blocks `num_rows` rows split into.

    Each block is one pass over the table (one `pallas_call`); the table and
    bias gradients accumulate across blocks.
    """
    padded = round_up(max(num_rows, 1), cfg.row_tile)
    count = pl.cdiv(padded, rows_per_pass(cfg, dim, hidden_itemsize, with_grads))
    return count, round_up(pl.cdiv(padded, count), cfg.row_tile)
