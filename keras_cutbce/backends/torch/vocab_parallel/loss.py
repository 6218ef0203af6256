"""The vocab-parallel losses: every rank's positions scored against this rank's rows, row statistics merged.

Forward: the positions' hidden states and target ids are all-gathered; this
rank runs the chunked loop's passes (`dense_pass`, `sparse_terms`) over its
rows with the family of the global V; the rows' `acc` and sparse terms of
every rank are all-gathered and folded in rank order with the family's
`merge` (the same numbers on every rank), then `finish` gives each position's
loss. Backward: the cotangents are all-gathered, the gradient pass runs on
the shard with the merged statistics, the hidden gradient goes back to the
position's rank by a reduce-scatter, and the table's (and bias's) stays on
the shard: the one-process gradient of the weighted sum of every rank's
losses. The table is never gathered.
"""

import functools

import torch

from keras_cutbce.backends.torch import chunked
from keras_cutbce.backends.torch import math
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.backends.torch.vocab_parallel import collectives
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import vocab_tiles

__all__ = ["cut_bce", "cut_softmax"]


class ShardPositives(chunked.Positives):
    """The gathered rows' positives on this rank's rows: `safe` local ids, `keep` those here, `counted` all."""

    def __init__(self, ids, layout, tiles):  # noqa: super().__init__ dedups over the shard only
        self.empty = ids.shape[1] == 0
        if self.empty:
            return
        safe, keep = distinct_targets(ids, layout.vocab)
        safe = safe.long()
        here = keep & (safe >= layout.start) & (safe < layout.stop)
        self.safe = torch.where(here, safe - layout.start, 0)
        self.keep, self.counted = here, keep
        self._rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        self._tile_bounds = tiles.bounds()


def _merged(acc, sparse, family, layout):
    """Every rank's `(acc, sparse)` folded in rank order: `acc` by `family.merge`, `sparse` summed."""
    rows = sparse.shape[0]
    both = torch.cat([acc.reshape(-1, rows), sparse[None]])
    parts = collectives.all_ranks(both, layout)
    acc_all, sparse_all = parts[0, :-1].reshape(acc.shape), parts[0, -1]
    for part in parts[1:]:
        acc_all = family.merge(acc_all, part[:-1].reshape(acc.shape))
        sparse_all = sparse_all + part[-1]
    return acc_all, sparse_all


class _VocabParallelLoss(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, shard, bias, ids, family, tile, layout, dense):
        dense = _dense_pass(dense, hidden, shard)
        dtype = compute_dtype(hidden, shard, bias)
        counts = collectives.row_counts(hidden.shape[0], layout, hidden.device)
        h = collectives.gather_rows(hidden.to(dtype), counts, layout)
        ids = collectives.gather_rows(ids, counts, layout)
        tiles = vocab_tiles(shard.shape[0], tile)
        positives = ShardPositives(ids, layout, tiles)
        acc, _, _, _ = dense(h, shard, bias, tiles, positives, loss=True, family=family)
        sparse = chunked.sparse_terms(h, shard, bias, positives, family, loss=True)
        acc, sparse = _merged(acc, sparse, family, layout)
        targets = None if positives.empty else positives.counted  # every rank's valid targets
        loss = family.finish(acc, sparse, targets, layout.vocab)
        stats = family.statistics(acc) if family.two_pass else None
        ctx.save_for_backward(h, shard, bias)
        ctx.state = (family, layout, counts, tiles, positives, targets, stats, hidden.dtype, dense)
        start = sum(counts[:layout.rank])
        return loss[start:start + hidden.shape[0]].float()

    @staticmethod
    def backward(ctx, row_scale):
        h, shard, bias = ctx.saved_tensors
        family, layout, counts, tiles, positives, targets, stats, hidden_dtype, dense = ctx.state
        row_scale = collectives.gather_rows(row_scale.to(h.dtype).contiguous(), counts, layout)
        h = chunked.mask_zero_rows(row_scale, h)
        dense_scale, sparse_scale = family.row_scale(row_scale, targets, layout.vocab)
        need = (True, ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        _, grad_h, grad_e, grad_b = dense(
            h, shard, bias, tiles, positives, loss=False, row_scale=dense_scale, need=need,
            family=family, stats=stats,
        )
        chunked.sparse_terms(h, shard, bias, positives, family, loss=False, row_scale=sparse_scale,
                             grads=(grad_h, grad_e, grad_b))
        grad_h = collectives.sum_rows_to_owner(grad_h, counts, layout).to(hidden_dtype)
        grad_e = None if grad_e is None else grad_e.contiguous().to(shard.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h if ctx.needs_input_grad[0] else None, grad_e, grad_b) + (None,) * 5


def _dense_pass(name, hidden, shard):
    """The shard's dense pass: the chunked loop's, or the Triton kernels' (`name == "triton"`)."""
    if name != "triton":
        return chunked.dense_pass
    from keras_cutbce.backends.torch.triton import launch

    return functools.partial(launch.dense_pass, operands=launch.operand_dtype(hidden),
                             stored=(torch.float32, shard.dtype))  # summed over ranks, then cast


def _loss(hidden, shard, ids, bias, family, chunk_size, layout, dense="chunked"):
    ids = torch.as_tensor(ids, device=hidden.device)
    ids = ids[:, None] if ids.ndim == 1 else ids
    tile = max(1, shard.shape[0]) if dense == "triton" else int(chunk_size)  # Triton: one tile a pass
    return _VocabParallelLoss.apply(hidden, shard, bias, ids, family, tile, layout, dense)


def cut_bce(hidden, shard, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size,
            layout, dense="chunked"):
    """`cut_bce` (the registry's contract) of this rank's positions over a table split by `layout`.

    `dense`: `"chunked"` (the chunked loop's tiles of `chunk_size`) or `"triton"` (the fused kernels).
    """
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _loss(hidden, shard, ids, bias, family, chunk_size, layout, dense)


def cut_softmax(hidden, shard, ids, bias=None, *, label_smoothing=0.0, chunk_size, layout):
    """`cut_softmax` (the registry's contract) over a table split by `layout`: `a / V` of the global V."""
    family = math.Softmax(float(label_smoothing), layout.vocab)
    return _loss(hidden, shard, ids, bias, family, chunk_size, layout)
