"""The tile and VMEM rule of the Pallas kernels.

The chunked kernels take their tile from `keras_cutbce.math.tiling` (a
budget for a few `[rows, tile]` float32 intermediates in cache or memory).
Pallas needs its own rule, because its tiles must fit VMEM, not a cache,
and Mosaic adds constraints XLA does not have:

- both tiles are multiples of 128 (MXU- and lane-aligned, and a multiple of
  the 8/16 sublanes of float32/bfloat16);
- the budget is half the target TPU's VMEM per TensorCore
  (`compile_platform.chip_info`), or 12 MiB (three quarters of the smallest
  default scoped VMEM, 16 MiB) for an unknown generation; the kernels then
  ask Mosaic for their estimated footprint with headroom, at most 3/4 of
  the capacity (`vmem_request_bytes`);
- row tile: `min(512, M rounded up to 128)`; vocabulary tile: the widest
  multiple of 128, at most 4096 and at most `V` rounded up to 128, whose
  estimated footprint fits the budget (double-buffered input tiles in the
  input dtype, float32 accumulators and output buffers, the step's scratch:
  `footprint_bytes`); if none fits, the row tile halves (down to 128);
- the resident rows of one pass (hidden states, ids, weights, loss and
  hidden gradient, double-buffered) take at most half of the budget;
  more rows run one pass per row block (`row_blocks`).
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import compile_platform
from keras_cutbce.common import round_up

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_TILE = 4096  # 32 hit bits x 128 lanes (`kernel._fill_hit_bits`)
PIECE_ROWS = 64  # a piece of a step's tile: [64, 512] float32, 32 vector registers
PIECE_COLS = 512
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20
DEFAULT_VMEM_BUDGET_BYTES = DEFAULT_SCOPED_VMEM_BYTES * 3 // 4


def vmem_capacity_bytes():
    """Returns the VMEM bytes of one TensorCore of the target TPU, or None when unknown."""
    chip = compile_platform.compiled_chip()
    return None if chip is None else chip.vmem_bytes


def tensorcores():
    """Returns the TensorCores one device of the target TPU drives (2 on v4 and v5p), else 1."""
    chip = compile_platform.compiled_chip()
    return 1 if chip is None else chip.cores


def vmem_budget_bytes(capacity=None):
    """Returns the tiles' VMEM budget: half of `capacity`, else `DEFAULT_VMEM_BUDGET_BYTES`."""
    return DEFAULT_VMEM_BUDGET_BYTES if capacity is None else capacity // 2


def footprint_bytes(row_tile, tile, dim, itemsize):
    """Returns the estimated VMEM bytes of one kernel step with these tiles.

    The table and bias tiles (double-buffered, input dtype), their float32
    accumulators and gradient outputs, and the step's scratch: two slope
    buffers (input dtype) and two float32 logits buffers of one piece
    column, the `[row_tile, 128]` loss, hit-bit and scale columns (and the
    pass building the hit bits), and the hidden states transposed and
    scaled.
    """
    tiles = 2 * tile * (dim * itemsize + 4)
    grads = 3 * tile * (dim + 1) * 4
    scratch = row_tile * (2 * PIECE_COLS * (itemsize + 4) + 6 * LANES * 4
                          + 2 * max(dim, LANES) * itemsize)
    return tiles + grads + scratch


def vmem_request_bytes(capacity, footprint, resident):
    """Returns the `vmem_limit_bytes` a kernel asks for: its estimate with headroom, capped.

    1.5 x (`footprint` + `resident` rows) + 4 MiB for Mosaic's own scratch,
    at most three quarters of `capacity` (the rest stays XLA's).
    """
    return int(min(capacity * 3 // 4, 3 * (footprint + resident) // 2 + 4 * 2**20))


def choose_tiles(num_rows, vocab_size, dim, dtype, budget_bytes=None):
    """Returns `(row_tile, tile)` for the kernels (the module's rule).

    Example:

    >>> choose_tiles(130, 1000, 64, "float32", budget_bytes=16 * 2**20)
    (256, 1024)
    """
    if budget_bytes is None:
        budget_bytes = vmem_budget_bytes(vmem_capacity_bytes())
    itemsize = jnp.dtype(dtype).itemsize
    row_tile = min(MAX_ROW_TILE, round_up(max(num_rows, 1), LANES))
    widest = min(MAX_TILE, round_up(max(vocab_size, 1), LANES))
    while True:
        for tile in range(widest, 0, -LANES):
            if footprint_bytes(row_tile, tile, dim, itemsize) <= budget_bytes:
                return row_tile, tile
        if row_tile <= MIN_ROW_TILE:
            return row_tile, LANES
        row_tile = max(MIN_ROW_TILE, row_tile // 2)


def num_tiles(cfg):
    """Returns the number of vocabulary tiles (the last one may be partial)."""
    return pl.cdiv(cfg.vocab_size, cfg.tile)


def cores_used(cfg):
    """Returns the TensorCores the vocabulary is split across (each gets at least one tile)."""
    return max(1, min(cfg.cores, num_tiles(cfg)))


def resident_bytes_per_row(dim, num_ids, hidden_itemsize, with_grads):
    """Returns the VMEM bytes a resident row costs a pass (double-buffered, sublane-padded)."""
    per_row = round_up(dim, 16) * hidden_itemsize + round_up(num_ids, 8) * 4 + 8 * 4
    if with_grads:
        per_row += 8 * 4 + round_up(dim, 8) * 4  # row_scale, hidden gradient
    return 2 * per_row


def resident_budget_bytes(cfg):
    """Returns the resident rows' VMEM share: half of the tiles' budget."""
    return vmem_budget_bytes(cfg.vmem_capacity) // 2


def row_blocks(num_rows, dim, hidden_itemsize, cfg, with_grads=True):
    """Returns `(count, block_rows)`: the resident row blocks `num_rows` rows split into.

    Each block is one pass over the table (one `pallas_call`); the table and
    bias gradients accumulate across blocks.
    """
    row_tile = cfg.row_tile
    padded = round_up(max(num_rows, 1), row_tile)
    per_row = resident_bytes_per_row(dim, cfg.num_ids, hidden_itemsize, with_grads)
    cap = max(row_tile, resident_budget_bytes(cfg) // per_row // row_tile * row_tile)
    count = pl.cdiv(padded, cap)
    return count, round_up(pl.cdiv(padded, count), row_tile)
