"""The positives of a torch pass: found once, then used by the tiles and the sparse part.

`Positives(ids, tiles)` runs `keras_cutbce.math.positives.distinct_targets`
(sort-based, O(M L)) once per pass and keeps what both parts of the pass
need: the safe ids and their keep mask (the sparse part gathers the table
rows there), and the kept `(row, item)` pairs sorted by item with the slice
of them each vocabulary tile owns (the tile loop sets them to `-inf` in the
tile's logits).
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
    >>> positives.keep.sum().item(), positives.flat(0).tolist()
    (4, [4, 5, 3])
    """

    def __init__(self, ids, tiles):
        self.empty = ids.shape[1] == 0
        if self.empty:
            return
        safe, keep = distinct_targets(ids, tiles.vocab_size)
        self.safe, self.keep = safe.long(), keep
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(self.safe)
        self._items, order = torch.sort(self.safe[keep])
        self._rows = rows[keep][order]
        starts = [start for start, _ in tiles.bounds()] + [tiles.vocab_size]
        # One host sync per pass: the slice of sorted positives each tile owns.
        self._bounds = torch.searchsorted(
            self._items, torch.tensor(starts, device=ids.device)
        ).tolist()
        self._tile_bounds = tiles.bounds()

    def flat(self, index):
        """Returns the flat offsets of tile `index`'s positives in its `[M, stop - start]` buffer.

        `row * (stop - start) + item - start` for each kept positive of the
        tile `[start, stop)`, or None when the tile has none.
        """
        if self.empty:
            return None
        lo, hi = self._bounds[index], self._bounds[index + 1]
        if lo == hi:
            return None
        start, stop = self._tile_bounds[index]
        return self._rows[lo:hi] * (stop - start) + (self._items[lo:hi] - start)

    def logits(self, hidden, table, bias, dtype):
        """Returns the table rows at the positives `[M, L, D]` and their logits `[M, L]`."""
        rows = table[self.safe].to(dtype)
        z = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            z = z + bias[self.safe].to(dtype)
        return rows, z
