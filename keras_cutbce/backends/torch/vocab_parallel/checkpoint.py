"""`gather_table`: a split table's (or bias's) whole `[V, ...]` value, for saving (the only time it is gathered).

A model saved under R ranks thus holds the same file as one process's: it
loads under any R' ranks (each keeps its rows) and in one process.
"""

import numpy as np
import torch

from keras_cutbce.backends.torch.vocab_parallel import collectives

__all__ = ["gather_table"]


def gather_table(shard, layout):
    """The whole table as a numpy array on every rank (a collective: every rank calls it)."""
    counts = [stop - start for start, stop in map(layout.bounds, range(layout.world))]
    with torch.no_grad():
        whole = collectives.gather_rows(shard.detach(), counts, layout)
    return np.asarray(whole.cpu().numpy())
