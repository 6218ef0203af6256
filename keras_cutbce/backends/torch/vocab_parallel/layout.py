"""`VocabLayout`: which rows of a `[V, D]` table each torch.distributed rank holds, and the group it is split over.

Rank `r` of `R` holds rows `[r * S, min(V, (r + 1) * S))`, `S = ceil(V / R)`.
"""

import math

import torch.distributed as dist

__all__ = ["VocabLayout", "layout_for"]


class VocabLayout:
    """The split of V items over the ranks of `group` (None: the world), this rank's `[start, stop)`."""

    __slots__ = ("vocab", "group", "rank", "world", "rows_per_rank", "start", "stop")

    def __init__(self, vocab, group=None):
        self.vocab = int(vocab)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.rows_per_rank = math.ceil(self.vocab / self.world)
        self.start, self.stop = self.bounds(self.rank)

    def bounds(self, rank):
        """`(start, stop)` of the rows rank `rank` holds."""
        return (min(self.vocab, rank * self.rows_per_rank),
                min(self.vocab, (rank + 1) * self.rows_per_rank))

    @property
    def rows(self):
        """The number of rows this rank holds."""
        return self.stop - self.start

    def __repr__(self):
        return (f"VocabLayout(vocab={self.vocab}, rank={self.rank}, world={self.world}, "
                f"rows=[{self.start}, {self.stop}))")


def layout_for(vocab, group=None):
    """The `VocabLayout` of `vocab` items over `group`; a clear error without an initialised group or rows per rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "`vocab_parallel=True` splits the item table over the ranks of a torch.distributed "
            "process group, and none is initialised: launch with `torchrun` and call "
            "`torch.distributed.init_process_group(...)` ('gloo' on CPU, 'nccl' on GPUs) before "
            "building the layer, or build it with `vocab_parallel=False`. "
            "Received: no initialised process group"
        )
    layout = VocabLayout(vocab, group)
    last = layout.bounds(layout.world - 1)
    if last[1] <= last[0]:
        raise ValueError(
            f"`vocab_parallel=True` gives rank r the rows [r*S, min(V, (r+1)*S)), S = ceil(V/R), "
            f"and with V = {layout.vocab} items over R = {layout.world} ranks the last rank would "
            f"hold none: use at least {(layout.world - 1) * layout.rows_per_rank + 1} items or "
            f"fewer ranks. Received: num_items={layout.vocab}, ranks={layout.world}"
        )
    return layout
