"""How wide a vocabulary tile is when the caller does not say.

The rule (`chunk_size=None`): a tile holds about four float32 `[rows, tile]`
intermediates (logits, their exponential, the loss or gradient term, and one
temporary), and those must fit in `DEFAULT_TILE_BUDGET_BYTES` (64 MiB). So

    tile = budget / (16 * rows), rounded down to a multiple of 128,
           clamped to [128, 8192], and never wider than V rounded up to 128.

At 4096 rows that is 1024 items a tile; at 1024 rows, 4096. Memory of the loss
is then O(rows * tile + V * D) whatever V is.
"""

DEFAULT_TILE_BUDGET_BYTES = 64 * 2**20
TILE_MULTIPLE = 128
MIN_TILE = 128
MAX_TILE = 8192


def round_up(value, multiple):
    """Rounds `value` up to a multiple of `multiple`."""
    return -(-int(value) // multiple) * multiple


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
