"""The negatives' samplers of `SampledSoftmaxLoss`: draws `[S]` with replacement from a seed, and every item's log q.

- `"uniform"`: `q(v) = 1 / V`;
- `"log_uniform"`: `q(v) = log((v + 2) / (v + 1)) / log(V + 1)`, TensorFlow's
  `log_uniform_candidate_sampler` (Zipfian: ids sorted by decreasing popularity);
- counts `[V]` (non-negative, e.g. each item's training frequency): `q(v) =
  counts[v] / sum(counts)`; an item of count 0 is never drawn, and its
  correction uses the smallest positive `q` (so a target never seen in the
  counts gets a finite logit).
"""

import math
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

__all__ = ["NAMES", "Sampler", "batch_log_counts", "item_counts", "make_sampler"]

NAMES = ("uniform", "log_uniform")


class Sampler(NamedTuple):
    """A sampler over `vocab` items: `kind` one of `NAMES` or `"counts"` (then `counts`, float64 `[V]`)."""

    kind: str
    vocab: int
    counts: object = None

    def draw(self, num, seed):
        """Int32 ids `[num]` drawn independently (with replacement) with `seed` (a `SeedGenerator` or a JAX key)."""
        if self.kind == "uniform":
            return ops.cast(keras.random.randint((num,), 0, self.vocab, seed=seed), "int32")
        u = keras.random.uniform((num,), dtype="float32", seed=seed)  # the same draws under any floatx
        if self.kind == "log_uniform":
            ids = ops.floor(ops.exp(u * math.log(self.vocab + 1.0))) - 1.0
        else:
            cdf = np.cumsum(self.counts) / np.sum(self.counts)
            ids = ops.searchsorted(ops.convert_to_tensor(cdf.astype("float32")), u, side="right")
        return ops.clip(ops.cast(ids, "int32"), 0, self.vocab - 1)

    def log_q(self):
        """Float32 `[V]`: each item's log-probability of a draw."""
        if self.kind == "uniform":
            return ops.zeros((self.vocab,), "float32") - math.log(self.vocab)
        if self.kind == "log_uniform":
            v = np.arange(self.vocab, dtype=np.float64)
            values = np.log(np.log1p(1.0 / (v + 1.0))) - math.log(math.log(self.vocab + 1.0))
        else:
            p = self.counts / np.sum(self.counts)
            values = np.log(np.maximum(p, np.min(p[p > 0])))
        return ops.convert_to_tensor(values.astype("float32"))


def make_sampler(sampler, vocab):
    """`sampler` (`"uniform"`, `"log_uniform"` or counts `[V]`) for `vocab` items, checked, as a `Sampler`."""
    if isinstance(sampler, str):
        if sampler not in NAMES:
            raise ValueError(
                f"`sampler` must be one of {NAMES} or item counts [V]. Received: sampler={sampler!r}"
            )
        return Sampler(sampler, int(vocab))
    counts = item_counts(sampler, vocab, "sampler")
    return Sampler("counts", int(vocab), counts)


def item_counts(counts, vocab, argument):
    """Host float64 counts `[V]`, finite, >= 0, with a positive sum (`ValueError` naming `argument`)."""
    try:
        values = np.asarray(ops.convert_to_numpy(counts) if ops.is_tensor(counts) else counts,
                            np.float64)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != (vocab,) or not np.all(np.isfinite(values)) or (
        np.any(values < 0) or not np.sum(values) > 0
    ):
        shape = None if values is None else values.shape
        raise ValueError(
            f"`{argument}` counts must be [V] = [{vocab}] finite numbers >= 0 with a positive "
            f"sum. Received: {argument} of shape {shape}"
        )
    return values


def batch_log_counts(ids, vocab):
    """Float32 `[V]`: the log of each item's count among the valid `ids` (any shape; `-inf` where absent)."""
    flat = ops.reshape(ids, (-1,))
    valid = ops.logical_and(flat >= 0, flat < vocab)
    counts = ops.segment_sum(ops.cast(valid, "float32"), ops.where(valid, flat, ops.zeros_like(flat)),
                             num_segments=vocab)
    return ops.log(counts)
