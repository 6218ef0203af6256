"""CutBCE on torch: a `torch.autograd.Function` looping over vocabulary tiles."""

import torch


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    hidden = hidden.float()
    table_tile = table_tile.float()
    if bias_tile is None:
        return hidden @ table_tile.T
    return torch.addmm(bias_tile.float(), hidden, table_tile.T)
