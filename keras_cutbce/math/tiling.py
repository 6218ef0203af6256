"""How the vocabulary splits into tiles: the width rule and the split rule (docs/cutbce.md, "Choosing `chunk_size`")."""

from typing import NamedTuple

from keras_cutbce.common import round_up

DEFAULT_TILE_BUDGET_BYTES = 64 * 2**20
CPU_CACHE_TILE_BUDGET_BYTES = 16 * 2**20
TORCH_CPU_TILE_BUDGET_BYTES = (128 * 2**20, 512 * 2**20)  # the table gradient, clamped
TILE_MULTIPLE = 128
MIN_TILE = 128
MAX_TILE = 8192
TORCH_CPU_MAX_TILE = 65536
# torch on CUDA: each tile's loop iteration is about ten kernel launches, so a 64 MiB tile (256 columns at
# 16384 rows) is launch-bound; 1 GiB of `[M, T]` buffers gives 4096-column tiles at 16384 rows, 32768 at 2048.
TORCH_CUDA_TILE_BUDGET_BYTES = 2**30
TORCH_CUDA_MAX_TILE = 65536
# torch CPU softmax: its two passes re-read each tile, so cache-sized tiles, widened to at most this many a
# pass (each tile is a dozen thread barriers, which spin when the cores are shared).
TORCH_CPU_SOFTMAX_MAX_TILES = 32


def tile_budget_bytes(backend, platform, table_bytes=0):
    """The width rule's budget for a Keras backend on a platform (torch CPU: `table_bytes`, clamped)."""
    if platform == "cpu" and backend in ("jax", "tensorflow"):
        return CPU_CACHE_TILE_BUDGET_BYTES
    if platform == "cpu" and backend == "torch":
        low, high = TORCH_CPU_TILE_BUDGET_BYTES
        return min(max(int(table_bytes), low), high)
    if (backend, platform) == ("torch", "gpu"):
        return TORCH_CUDA_TILE_BUDGET_BYTES
    return DEFAULT_TILE_BUDGET_BYTES


def max_tile(backend, platform):
    """The widest tile of the width rule for a Keras backend on a platform."""
    if backend == "torch" and platform in ("cpu", "gpu"):
        return TORCH_CUDA_MAX_TILE if platform == "gpu" else TORCH_CPU_MAX_TILE
    return MAX_TILE


def default_chunk_size(num_rows, vocab_size, budget_bytes=DEFAULT_TILE_BUDGET_BYTES,
                       widest=MAX_TILE):
    """The vocabulary tile for `num_rows` rows and `vocab_size` items (`chunk_size=None`).

    >>> default_chunk_size(4096, 131072), default_chunk_size(8, 1000)
    (1024, 1024)
    """
    per_column = 16 * max(int(num_rows), 1)
    tile = (budget_bytes // per_column) // TILE_MULTIPLE * TILE_MULTIPLE
    tile = min(max(tile, MIN_TILE), widest)
    return min(tile, round_up(max(int(vocab_size), 1), TILE_MULTIPLE))


def torch_cpu_softmax_tile(num_rows, vocab_size, widest):
    """torch CPU softmax's tile: the cache's, widened to at most `TORCH_CPU_SOFTMAX_MAX_TILES`, within `widest`.

    >>> torch_cpu_softmax_tile(4096, 32768, 2048), torch_cpu_softmax_tile(640, 10**6, 26112)
    (1024, 26112)
    """
    cache = default_chunk_size(num_rows, vocab_size, CPU_CACHE_TILE_BUDGET_BYTES, TORCH_CPU_MAX_TILE)
    few = round_up(-(-max(int(vocab_size), 1) // TORCH_CPU_SOFTMAX_MAX_TILES), TILE_MULTIPLE)
    return min(max(cache, few), widest)


def default_tile(backend, platform, rows, vocab_size, dim, family="bce"):
    """The chunked loops' tile for `chunk_size=None` (`rows`, `vocab_size`, `dim`: ints, None where unknown).

    >>> default_tile("jax", "cpu", 4096, 131072, 64), default_tile("torch", "cpu", 640, 10**6, 64, "softmax")
    (256, 24960)
    """
    rows, vocab_size = rows or 4096, vocab_size or 2**20
    budget = tile_budget_bytes(backend, platform, table_bytes=4 * vocab_size * (dim or 0))
    tile = default_chunk_size(rows, vocab_size, budget, max_tile(backend, platform))
    if family == "softmax" and (backend, platform) == ("torch", "cpu"):
        tile = torch_cpu_softmax_tile(rows, vocab_size, tile)
    return tile


class VocabTiles(NamedTuple):
    """The split of `[0, V)`: `num_full = V // tile` full tiles, then a `remainder`-wide one (V may be a tensor)."""

    vocab_size: object
    tile: int
    num_full: object
    remainder: object

    @property
    def remainder_start(self):
        return self.num_full * self.tile

    def bounds(self):
        """The `(start, stop)` of every tile, in order (a static V only)."""
        full = [(i * self.tile, (i + 1) * self.tile) for i in range(self.num_full)]
        if self.remainder:
            full.append((self.remainder_start, self.vocab_size))
        return full


def vocab_tiles(vocab_size, tile):
    """The `VocabTiles` of `[0, vocab_size)` for a checked `tile` (narrowed to a static V)."""
    tile = int(tile)
    assert tile > 0, tile
    if isinstance(vocab_size, int):
        tile = max(1, min(tile, vocab_size))
    num_full = vocab_size // tile
    return VocabTiles(vocab_size, tile, num_full, vocab_size - num_full * tile)
