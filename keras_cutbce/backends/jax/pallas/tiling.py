"""The static settings of a Pallas call and pass (`Config`, `Pass`), and the kernels' tile and VMEM rule.

The rule (docs/tpu.md, "Scoped VMEM"): tiles are multiples of 128; a pass's estimate fits 7/8 of the scoped VMEM it
asks for (at most 3/4 of the chip's, else 16 MiB); the tiles take 3/4 of
that budget, resident rows the rest (at most a quarter).
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import compile_platform
from keras_cutbce.common import round_up

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_TILE = 4096  # 32 hit bits x 128 lanes (`kernel._fill_hit_bits`)
TILE_STEP = 256  # tile widths below the widest: whole 256-wide piece columns
PIECE_ROWS = 64  # a piece of a step's tile: 64 rows (float32 [64, 256]: 16 vector registers)
PIECE_COLS = 512  # the widest piece (softmax's: its statistics rescale their sums once a piece)
BCE_PIECE_COLS = 256  # BCE's pieces: libtpu packs its schedule tighter (docs/tpu.md)
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20  # the compiler's limit when a kernel asks for none


class Config(NamedTuple):
    """Static (hashable) settings of one call, the same for all its passes (docs/tpu.md)."""

    vocab_size: int  # V
    coef: object  # BCE's `BCECoefficients`, or softmax's `math.Softmax`
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
    family: str = "bce"  # the loss family: "bce" or "softmax"
    positives: bool = True  # softmax: the kernels find the rows' ids (hit bits); False: no ids
    newton_reciprocal: bool = False  # BCE's `1 / u` as the approximate reciprocal and one Newton step

    @property
    def softmax(self):
        return self.family == "softmax"


class Pass(NamedTuple):
    """Static shape of one pass over the table for one block of resident rows."""

    has_bias: bool
    with_loss: bool  # writes the rows' loss sums (softmax: max and sum exp)
    with_grads: bool  # writes the gradients, rows weighted by `row_scale`
    carry: bool  # the table and bias gradients add to earlier blocks' (aliased)
    block_rows: int  # resident rows of this pass
    tiles_per_core: int
    counts_per_row_tile: bool  # in-tile id counts per (tile, row tile), else per tile
    positive_sums: bool = False  # softmax: writes the sums of the rows' positives' logits


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
    """Returns `(count, block_rows)`: the resident row blocks, one pass over the table each."""
    padded = round_up(max(num_rows, 1), cfg.row_tile)
    count = pl.cdiv(padded, rows_per_pass(cfg, dim, hidden_itemsize, with_grads))
    return count, round_up(pl.cdiv(padded, count), cfg.row_tile)
