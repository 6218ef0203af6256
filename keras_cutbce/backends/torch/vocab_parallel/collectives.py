"""The collectives of the vocab-parallel ops: rows gathered from every rank, row sums scattered back.

Each rank brings its own number of rows (positions); `row_counts` reads them
once per call (one small all-gather, read on the host), the others pad to the
largest count. NCCL sums and scatters in one `reduce_scatter`; gloo, which
has none, all-reduces and keeps its own rows.
"""

import torch
import torch.distributed as dist

__all__ = ["all_ranks", "gather_rows", "row_counts", "sum_rows_to_owner", "sum_over_ranks"]


def row_counts(rows, layout, device):
    """Every rank's number of rows, in rank order (a list of ints)."""
    mine = torch.full((1,), int(rows), dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(layout.world)]
    dist.all_gather(counts, mine, group=layout.group)
    return [int(c) for c in torch.cat(counts).tolist()]


def _padded(x, rows):
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad]).contiguous()


def all_ranks(x, layout):
    """`[R, ...]`: `x` (the same shape on every rank) from every rank, stacked in rank order."""
    x = x.contiguous()
    out = x.new_empty((layout.world * x.shape[0],) + tuple(x.shape[1:]))  # gloo: concatenated
    dist.all_gather_into_tensor(out, x, group=layout.group)
    return out.view((layout.world,) + tuple(x.shape))


def gather_rows(x, counts, layout):
    """`[sum(counts), ...]`: every rank's rows of `x`, concatenated in rank order."""
    top = max(counts)
    stacked = all_ranks(_padded(x, top), layout)
    return torch.cat([stacked[r, :n] for r, n in enumerate(counts)])


def sum_over_ranks(x, layout):
    """`x` summed over the ranks (an all-reduce, in place on a copy)."""
    x = x.clone()
    dist.all_reduce(x, group=layout.group)
    return x


def sum_rows_to_owner(x, counts, layout):
    """This rank's rows of `x` `[sum(counts), ...]` summed over the ranks: the reverse of `gather_rows`."""
    top = max(counts)
    offsets = [sum(counts[:r]) for r in range(layout.world)]
    pieces = [_padded(x[o:o + n], top) for o, n in zip(offsets, counts)]
    stacked = torch.cat(pieces)
    if dist.get_backend(layout.group) == "nccl":
        out = x.new_empty((top,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, stacked, group=layout.group)
    else:  # gloo has no reduce_scatter
        dist.all_reduce(stacked, group=layout.group)
        out = stacked[layout.rank * top:(layout.rank + 1) * top]
    return out[:counts[layout.rank]]
