"""Top-k retrieval and rank counts on torch, one `[M, T]` tile of logits at a time (the contract: the registry)."""

import torch

from keras_cutbce.backends.torch.chunked import tile_logits
from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.tiling import vocab_tiles


def _tiles(vocab_size, tile):
    return vocab_tiles(vocab_size, tile).bounds()


def _excluded_mask(exclude_ids, start, stop):
    tile = stop - start
    local = exclude_ids.long() - start
    local = torch.where((local >= 0) & (local < tile), local, tile)  # tile: dropped
    mask = torch.zeros(
        (exclude_ids.shape[0], tile + 1), dtype=torch.bool, device=exclude_ids.device
    )
    mask.scatter_(1, local, True)
    return mask[:, :tile]


def _order_keys(x):
    """Distinct int64 keys ordering as (value descending, column ascending), NaN above `+inf` as `torch.sort`."""
    x = torch.where(torch.isnan(x), torch.nan, x.float() + 0.0)
    bits = x.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    columns = torch.arange(x.shape[1], device=x.device, dtype=torch.int64)
    return (ordered << 32) | (2**32 - 1 - columns)


def _top_k_by_keys(x, k):
    if x.dtype == torch.float64:  # no room for the column beside 64 value bits
        values, columns = torch.sort(x, dim=1, descending=True, stable=True)
        return values[:, :k], columns[:, :k]
    _, columns = torch.topk(_order_keys(x), k, dim=1, sorted=True)
    return x.gather(1, columns), columns


def _top_k_reading_ties(x, k):
    rows, width = x.shape
    if k >= width:
        return torch.sort(x, dim=1, descending=True, stable=True)
    values, columns = torch.topk(x, k + 1, dim=1, sorted=True)
    if bool(torch.isnan(values).any()):  # NaN logits: the order of a full stable sort
        values, columns = torch.sort(x, dim=1, descending=True, stable=True)
        return values[:, :k], columns[:, :k]
    kth = values[:, k - 1 : k]
    if bool((values[:, k : k + 1] == kth).any()):
        above = x > kth
        tied = x == kth
        room = k - above.sum(dim=1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(dim=1) <= room))
        columns = chosen.nonzero()[:, 1].view(rows, k)
    else:
        columns, _ = torch.sort(columns[:, :k], dim=1)
    values, order = torch.sort(x.gather(1, columns), dim=1, descending=True, stable=True)
    return values, columns.gather(1, order)


def host_reads_are_free(device):
    """Whether reading a value of a tensor on `device` on the host costs no sync (CPU)."""
    return device.type == "cpu"


def _stable_top_k(x, k):
    """The top k of each row, ties to the lower column: `(values, columns)`, no host read off CPU."""
    k = min(k, x.shape[1])
    if host_reads_are_free(x.device):
        return _top_k_reading_ties(x, k)
    return _top_k_by_keys(x, k)


def _bias_tile(bias, start, stop):
    return None if bias is None else bias[start:stop]


@torch.no_grad()
def top_k(hidden, table, k, bias=None, exclude_ids=None, *, chunk_size):
    """The retrieval `top_k` (the contract: `keras_cutbce.registry`)."""
    rows, device = hidden.shape[0], hidden.device
    best_scores = torch.full((rows, k), -torch.inf, dtype=torch.float32, device=device)
    best_ids = torch.full((rows, k), EMPTY_ID, dtype=torch.int64, device=device)
    nan_rows = torch.zeros((rows, 1), dtype=torch.bool, device=device)
    for start, stop in _tiles(table.shape[0], chunk_size):
        z = tile_logits(hidden, table[start:stop], _bias_tile(bias, start, stop))
        nan_rows |= torch.isnan(z).any(dim=1, keepdim=True)
        if exclude_ids is not None:
            z = z.masked_fill(_excluded_mask(exclude_ids, start, stop), -torch.inf)
        # The tile's own top k (ties to the lower id), then a stable merge:
        # running entries first, as their ids are lower than the tile's.
        tile_scores, tile_columns = _stable_top_k(z, min(k, stop - start))
        scores = torch.cat([best_scores, tile_scores], dim=1)
        ids = torch.cat([best_ids, tile_columns + start], dim=1)
        scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
        best_scores = scores[:, :k].contiguous()
        best_ids = torch.gather(ids, 1, order[:, :k])
    best_ids = torch.where((best_scores == -torch.inf) | nan_rows, EMPTY_ID, best_ids)
    return best_scores.masked_fill(nan_rows, torch.nan), best_ids.to(torch.int32)


@torch.no_grad()
def count_above(hidden, table, bias, scores, ids, exclude_ids=None, *, chunk_size):
    """The retrieval `count_above` (the contract: `keras_cutbce.registry`)."""
    rows, device = hidden.shape[0], hidden.device
    scores = scores.float()[:, None]
    ids = ids.long()[:, None]
    counts = torch.zeros(rows, dtype=torch.int64, device=device)
    nan_rows = torch.zeros(rows, dtype=torch.bool, device=device)
    for start, stop in _tiles(table.shape[0], chunk_size):
        z = tile_logits(hidden, table[start:stop], _bias_tile(bias, start, stop))
        nan_rows |= torch.isnan(z).any(dim=1)
        columns = torch.arange(start, stop, device=device)[None, :]
        above = (z > scores) | ((z == scores) & (columns < ids))
        above &= columns != ids
        if exclude_ids is not None:
            above &= ~_excluded_mask(exclude_ids, start, stop)
        counts += above.sum(dim=1)
    return torch.where(nan_rows, -1, counts).to(torch.int32)
