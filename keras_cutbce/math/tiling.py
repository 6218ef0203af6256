"""How the vocabulary splits into tiles: the width rule and the split rule.

The width rule (`chunk_size=None`, `default_chunk_size`): a tile holds about
four float32 `[rows, tile]` intermediates (logits, their exponential, the
loss or gradient term, and one temporary), and those must fit in a budget:

    tile = budget / (16 * rows), rounded down to a multiple of 128,
           clamped to [128, max_tile], and never wider than V rounded up to 128.

The budget is 64 MiB and `max_tile` 8192 (`DEFAULT_TILE_BUDGET_BYTES`,
`MAX_TILE`: 1024 items a tile at 4096 rows, 4096 at 1024 rows), except on
CPU:

- JAX and TensorFlow: 16 MiB (`CPU_CACHE_TILE_BUDGET_BYTES`: 256 items at
  4096 rows, 1024 at 1024 rows). Their tile loop is one compiled program, and
  a tile that stays in cache is faster;
- torch: the size of the float32 table gradient `V x D x 4` bytes, which a
  training step holds anyway, within [128 MiB, 512 MiB]
  (`TORCH_CPU_TILE_BUDGET_BYTES`), and at most 65536 items
  (`TORCH_CPU_MAX_TILE`). At 10^6 items and D = 64 (a 256 MiB gradient):
  3072 items at 5120 rows, 12416 at 1280 rows, 65536 at 160 rows. Its tile
  loop runs a dozen parallel regions per tile from Python, each ending at a
  barrier of all its threads: a tile's fixed cost is paid V / tile times,
  so fewer, wider tiles win, most at few rows
  (`benchmarks/cutbce_torch_tile.py` measures it).

`benchmarks/cutbce_cpu.py` measures the CPU choice on every backend. Memory
of the loss is O(rows * tile + V * D) whatever V is; a smaller `chunk_size`
trades time for memory (docs/cutbce.md, "Choosing `chunk_size`").

The split rule (`vocab_tiles`), the same for every chunked kernel: a tile is
at most V wide; `V // tile` full tiles start at `0, tile, 2 tile, ...`, then
one narrower remainder tile of `V % tile` items when `tile` does not divide
V. The table is sliced, never padded.
"""

from typing import NamedTuple

from keras_cutbce.common import round_up

DEFAULT_TILE_BUDGET_BYTES = 64 * 2**20
CPU_CACHE_TILE_BUDGET_BYTES = 16 * 2**20
TORCH_CPU_TILE_BUDGET_BYTES = (128 * 2**20, 512 * 2**20)  # the table gradient, clamped
TILE_MULTIPLE = 128
MIN_TILE = 128
MAX_TILE = 8192
TORCH_CPU_MAX_TILE = 65536


def tile_budget_bytes(backend, platform, table_bytes=0):
    """Returns the tile budget of the width rule for a Keras backend on a platform.

    `table_bytes` is the size of the float32 table `V x D x 4` (torch CPU
    budgets that much, within `TORCH_CPU_TILE_BUDGET_BYTES`).

    Example:

    >>> tile_budget_bytes("jax", "cpu") // 2**20, tile_budget_bytes("torch", "cpu") // 2**20
    (16, 128)
    >>> tile_budget_bytes("torch", "cpu", table_bytes=10**6 * 64 * 4) // 2**20
    244
    """
    if platform == "cpu" and backend in ("jax", "tensorflow"):
        return CPU_CACHE_TILE_BUDGET_BYTES
    if platform == "cpu" and backend == "torch":
        low, high = TORCH_CPU_TILE_BUDGET_BYTES
        return min(max(int(table_bytes), low), high)
    return DEFAULT_TILE_BUDGET_BYTES


def max_tile(backend, platform):
    """Returns the widest tile of the width rule for a Keras backend on a platform.

    Example:

    >>> max_tile("jax", "cpu"), max_tile("torch", "cpu")
    (8192, 65536)
    """
    return TORCH_CPU_MAX_TILE if (backend, platform) == ("torch", "cpu") else MAX_TILE


def default_chunk_size(num_rows, vocab_size, budget_bytes=DEFAULT_TILE_BUDGET_BYTES,
                       widest=MAX_TILE):
    """Returns the vocabulary tile width for `num_rows` rows and `vocab_size` items.

    `budget_bytes` and `widest` are the backend's (`tile_budget_bytes`,
    `max_tile`).

    Example:

    >>> default_chunk_size(4096, 131072)
    1024
    >>> default_chunk_size(8, 1000)
    1024
    >>> torch_cpu = tile_budget_bytes("torch", "cpu", 10**6 * 64 * 4), max_tile("torch", "cpu")
    >>> default_chunk_size(5120, 10**6, *torch_cpu), default_chunk_size(160, 10**6, *torch_cpu)
    (3072, 65536)
    """
    per_column = 16 * max(int(num_rows), 1)
    tile = (budget_bytes // per_column) // TILE_MULTIPLE * TILE_MULTIPLE
    tile = min(max(tile, MIN_TILE), widest)
    return min(tile, round_up(max(int(vocab_size), 1), TILE_MULTIPLE))


class VocabTiles(NamedTuple):
    """The split of the vocabulary `[0, V)` into tiles (see `vocab_tiles`).

    Attributes:
        vocab_size: V (a Python int, or a scalar integer tensor for a V
            unknown when the program is traced).
        tile: the width of a full tile (a Python int).
        num_full: how many full tiles, `V // tile`.
        remainder: the width of the last, narrower tile, `V % tile` (0: none).
    """

    vocab_size: object
    tile: int
    num_full: object
    remainder: object

    @property
    def remainder_start(self):
        """Returns the first item of the remainder tile, `num_full * tile`."""
        return self.num_full * self.tile

    def bounds(self):
        """Returns the `(start, stop)` of every tile, in order (a static V only).

        Example:

        >>> vocab_tiles(10, 4).bounds()
        [(0, 4), (4, 8), (8, 10)]
        """
        full = [(i * self.tile, (i + 1) * self.tile) for i in range(self.num_full)]
        if self.remainder:
            full.append((self.remainder_start, self.vocab_size))
        return full


def vocab_tiles(vocab_size, tile):
    """Splits the vocabulary `[0, vocab_size)` into tiles of `tile` items.

    Args:
        vocab_size: V, a Python int, or a scalar integer tensor (then the
            tile is not narrowed to V, and `num_full` and `remainder` are
            tensors).
        tile: positive int, the requested tile width (the public
            `chunk_size`, already checked).

    Returns:
        A `VocabTiles`.

    Example:

    >>> vocab_tiles(10, 4)
    VocabTiles(vocab_size=10, tile=4, num_full=2, remainder=2)
    >>> vocab_tiles(10, 64)
    VocabTiles(vocab_size=10, tile=10, num_full=1, remainder=0)
    """
    tile = int(tile)
    assert tile > 0, tile
    if isinstance(vocab_size, int):
        tile = max(1, min(tile, vocab_size))
    num_full = vocab_size // tile
    return VocabTiles(vocab_size, tile, num_full, vocab_size - num_full * tile)
