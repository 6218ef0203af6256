"""How wide a vocabulary tile is when the caller does not say.

The rule (`chunk_size=None`): a tile holds about four float32 `[rows, tile]`
intermediates (logits, their exponential, the loss or gradient term, and one
temporary), and those must fit in a budget:

    tile = budget / (16 * rows), rounded down to a multiple of 128,
           clamped to [128, 8192], and never wider than V rounded up to 128.

The budget is 64 MiB (`DEFAULT_TILE_BUDGET_BYTES`: 1024 items a tile at 4096
rows, 4096 at 1024 rows), except for JAX and TensorFlow on CPU, where a tile
that stays in cache is faster: 16 MiB (`CPU_CACHE_TILE_BUDGET_BYTES`: 256
items at 4096 rows, 1024 at 1024 rows). Measured on 2 cores, forward+backward
at (4096, 64, 32768): JAX 1.0-1.2 s at tile 256 vs 1.25-1.56 s at 1024;
TensorFlow 1.85-2.08 s vs 2.30-2.86 s; torch 1.65-1.73 s vs 1.56-1.57 s (so
torch keeps 64 MiB). Memory of the loss is O(rows * tile + V * D) whatever V is.
"""

from keras_cutbce.common import round_up

DEFAULT_TILE_BUDGET_BYTES = 64 * 2**20
CPU_CACHE_TILE_BUDGET_BYTES = 16 * 2**20
TILE_MULTIPLE = 128
MIN_TILE = 128
MAX_TILE = 8192


def tile_budget_bytes(backend, platform):
    """The tile budget of the rule above for a Keras backend on a platform.

    Example:

    >>> tile_budget_bytes("jax", "cpu") // 2**20, tile_budget_bytes("torch", "cpu") // 2**20
    (16, 64)
    """
    if platform == "cpu" and backend in ("jax", "tensorflow"):
        return CPU_CACHE_TILE_BUDGET_BYTES
    return DEFAULT_TILE_BUDGET_BYTES


def default_chunk_size(num_rows, vocab_size, budget_bytes=DEFAULT_TILE_BUDGET_BYTES):
    """Returns the vocabulary tile width for `num_rows` rows and `vocab_size` items.

    Example:

    >>> default_chunk_size(4096, 131072)
    1024
    >>> default_chunk_size(8, 1000)
    1024
    """
    per_column = 16 * max(int(num_rows), 1)
    tile = (budget_bytes // per_column) // TILE_MULTIPLE * TILE_MULTIPLE
    tile = min(max(tile, MIN_TILE), MAX_TILE)
    return min(tile, round_up(max(int(vocab_size), 1), TILE_MULTIPLE))
