"""Top-k and rank counts over a table split by rows: every rank's positions against this rank's rows, merged.

The positions (and their exclusions, scores and ids) are all-gathered; each
rank runs the chunked `top_k` / `count_above` on its rows with ids shifted to
them; the per-rank results are all-gathered and merged in rank order (top-k:
a stable sort of the ranks' lists, lower ids first at ties; counts: a sum,
-1 where a rank saw a NaN logit). Each rank keeps its own positions.
"""

import torch

from keras_cutbce.backends.torch import retrieval
from keras_cutbce.backends.torch.vocab_parallel import collectives
from keras_cutbce.common import EMPTY_ID

__all__ = ["count_above", "top_k"]


def _gathered(layout, hidden, *others):
    counts = collectives.row_counts(hidden.shape[0], layout, hidden.device)
    gathered = [None if x is None else collectives.gather_rows(x, counts, layout)
                for x in (hidden,) + others]
    start = sum(counts[:layout.rank])
    return gathered, slice(start, start + hidden.shape[0])


def _shifted(ids, layout):
    return None if ids is None else ids.long() - layout.start


@torch.no_grad()
def top_k(hidden, shard, k, bias=None, exclude_ids=None, *, chunk_size, layout):
    """The registry's `top_k` of this rank's positions over the table split by `layout`."""
    (h, excluded), mine = _gathered(layout, hidden, exclude_ids)
    scores, ids = retrieval.top_k(h, shard, k, bias, _shifted(excluded, layout), chunk_size=chunk_size)
    ids = torch.where(ids == EMPTY_ID, EMPTY_ID, ids.long() + layout.start)
    all_scores = collectives.all_ranks(scores, layout)
    all_ids = collectives.all_ranks(ids, layout)
    nan_rows = torch.isnan(all_scores).any(dim=0).any(dim=1, keepdim=True)
    merged = torch.cat(list(all_scores), dim=1)
    merged_ids = torch.cat(list(all_ids), dim=1)
    merged, order = torch.sort(merged, dim=1, descending=True, stable=True)
    best = merged[:, :k]
    best_ids = torch.gather(merged_ids, 1, order[:, :k])
    best_ids = torch.where((best == -torch.inf) | nan_rows, EMPTY_ID, best_ids)
    best = best.masked_fill(nan_rows, torch.nan)
    return best[mine], best_ids[mine].to(torch.int32)


@torch.no_grad()
def count_above(hidden, shard, bias, scores, ids, exclude_ids=None, *, chunk_size, layout):
    """The registry's `count_above` of this rank's positions over the table split by `layout`."""
    (h, s, i, excluded), mine = _gathered(layout, hidden, scores.float(), ids.long(), exclude_ids)
    counts = retrieval.count_above(h, shard, bias, s, _shifted(i, layout), _shifted(excluded, layout),
                                   chunk_size=chunk_size)
    parts = collectives.all_ranks(counts.long(), layout)
    total = torch.where((parts < 0).any(dim=0), -1, parts.sum(dim=0))
    return total[mine].to(torch.int32)
