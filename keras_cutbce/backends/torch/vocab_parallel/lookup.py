"""`lookup`: the rows of a table split over ranks at each rank's own ids (a masked gather and one reduction).

The ids are all-gathered; each rank gathers the rows it holds (zeros for the
others), and the sum over ranks goes back to each id's rank (a reduce-scatter
on NCCL, an all-reduce on gloo). Backward: every rank's output gradient is
all-gathered and added into the rows of this rank's shard (in a fixed order).
"""

import torch

from keras_cutbce.backends.torch.chunked import add_rows
from keras_cutbce.backends.torch.vocab_parallel import collectives

__all__ = ["lookup"]


def _local(ids, layout):
    here = (ids >= layout.start) & (ids < layout.stop)
    return torch.where(here, ids - layout.start, 0), here


class _Lookup(torch.autograd.Function):

    @staticmethod
    def forward(ctx, shard, ids, layout):
        counts = collectives.row_counts(ids.shape[0], layout, ids.device)
        local, here = _local(collectives.gather_rows(ids, counts, layout), layout)
        rows = torch.where(here[:, None], shard[local], torch.zeros((), dtype=shard.dtype))
        ctx.save_for_backward(local, here)
        ctx.state = (layout, counts, shard.shape, shard.dtype)
        return collectives.sum_rows_to_owner(rows, counts, layout)

    @staticmethod
    def backward(ctx, grad):
        local, here = ctx.saved_tensors
        layout, counts, shape, dtype = ctx.state
        grad = collectives.gather_rows(grad.contiguous(), counts, layout)
        grad = torch.where(here[:, None], grad, torch.zeros((), dtype=grad.dtype))
        out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        add_rows(out, local, grad)
        return out.to(dtype), None, None


def lookup(shard, ids, layout):
    """`table[ids]` `[..., D]` for this rank's `ids` (any shape, global ids in `[0, V)`), `shard` its rows."""
    flat = torch.as_tensor(ids, device=shard.device).reshape(-1).long()
    rows = _Lookup.apply(shard, flat, layout)
    return rows.reshape(tuple(ids.shape) + (shard.shape[1],))


def item_logits(hidden, shard, bias, ids, layout):
    """`math.positives.item_logits` of this rank's rows over a split table (ids outside `[0, V)` read item 0)."""
    ids = torch.as_tensor(ids, device=shard.device).long()
    safe = torch.where((ids >= 0) & (ids < layout.vocab), ids, 0)
    rows = lookup(shard, safe, layout).float()  # [M, L, D]
    logits = (hidden.float()[:, None, :] * rows).sum(-1)
    if bias is not None:
        logits = logits + lookup(bias[:, None], safe, layout)[..., 0].float()
    return logits
