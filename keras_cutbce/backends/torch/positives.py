"""The positives of a torch pass: found once, then used by the tiles and the sparse part.

`Positives(ids, tiles)` runs `keras_cutbce.math.positives.distinct_targets`
(sort-based, O(M L), no host read) once per pass and keeps what both parts
of the pass need: the safe ids and their keep mask (the sparse part gathers the table
rows there, the tile loop sets each tile's own to `-inf` in its logits).
Which positives a tile owns is a mask over the `[M, L]` ids, never a count
or a slice read on the host: O(M L) per tile, no device-to-host sync and
no graph break under `torch.compile`.
"""

import torch

from keras_cutbce.math.positives import distinct_targets


class Positives:
    """The valid, de-duplicated target ids of one pass, and where each tile's sit.

    Attributes:
        empty: True when there are no target columns (`L = 0`).
        safe: int64 `[M, L]` ids; every entry that is not kept points at item 0.
        keep: bool `[M, L]`, the valid first occurrences.

    Example:

    >>> from keras_cutbce.math.tiling import vocab_tiles
    >>> positives = Positives(torch.tensor([[3, -1, 3], [0, 9, 1]]), vocab_tiles(10, 4))
    >>> positives.keep.sum().item(), sorted(positives.flat(0).tolist())
    (4, [3, 4, 5, 8, 8, 8])
    """

    def __init__(self, ids, tiles):
        self.empty = ids.shape[1] == 0
        if self.empty:
            return
        safe, keep = distinct_targets(ids, tiles.vocab_size)
        self.safe, self.keep = safe.long(), keep
        self._rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        self._tile_bounds = tiles.bounds()

    def flat(self, index):
        """Returns the flat offsets of tile `index`'s positives in its `[M, stop - start]` buffer.

        `row * (stop - start) + item - start` for each kept positive of the
        tile `[start, stop)`, as an int64 `[M * L]`; every other entry is
        `M * (stop - start)`, one past the tile's buffer: the caller's
        buffer has a spare element there. None when there are no targets.
        """
        if self.empty:
            return None
        start, stop = self._tile_bounds[index]
        width = stop - start
        in_tile = self.keep & (self.safe >= start) & (self.safe < stop)
        offsets = self._rows * width + (self.safe - start)
        spare = torch.full((), self.safe.shape[0] * width, dtype=offsets.dtype, device=offsets.device)
        return torch.where(in_tile, offsets, spare).reshape(-1)
    def logits(self, hidden, table, bias, dtype):
        """Returns the table rows at the positives `[M, L, D]` and their logits `[M, L]`."""
        rows = table[self.safe].to(dtype)
        z = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            z = z + bias[self.safe].to(dtype)
        return rows, z
