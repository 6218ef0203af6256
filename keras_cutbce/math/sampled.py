"""Sampled softmax: its loss family (`SampledSoftmax`, in `keras.ops`) and the gather kernel `cut_sampled_softmax`.

The family has the method names of the tile loops' families
(docs/development.md, "The loss family"): the kernel runs it over two
"tiles", the rows' targets `[M, L]` and the shared negatives `[M, S]`, with no
loop over the vocabulary; every backend's autodiff gives the gradients.

Per row, each candidate's logit is `z = (h . E_id + b_id) / temperature -
log_q`, in that order, then masked (`-inf`): padding targets, duplicate
targets (a repeated id counts once), padding negatives and, with
`remove_accidental_hits`, every negative equal to one of the row's targets
(each occurrence). The loss is `logsumexp(candidates) - mean(targets' z)`;
a row without a valid target is 0, with no gradient.
"""

from typing import NamedTuple

from keras import ops

from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.positives import item_logits

__all__ = ["SampledSoftmax", "candidate_logits", "cut_sampled_softmax", "sampled_softmax_loss"]

_NEG_INF = float("-inf")


class SampledSoftmax(NamedTuple):
    """Softmax cross-entropy over sampled candidates as a loss family (docs/development.md); hashable.

    A tile reduces to each row's `(max, sum exp(z - max))`, merged by
    rescaling (exact at saturated logits); `-inf` candidates add nothing and
    no gradient (the max is a constant of the autodiff: its terms cancel).
    """

    masks_positives = False  # the targets are candidates of the softmax
    two_pass = False  # the gather path differentiates the loss; `tile`'s slopes are the protocol's

    def init(self, rows):
        zeros = ops.zeros((rows,), "float32")
        return zeros + _NEG_INF, zeros

    def merge(self, acc, part):
        (m1, s1), (m2, s2) = acc, part
        m = ops.maximum(m1, m2)
        return m, _rescaled(s1, m1, m) + _rescaled(s2, m2, m)

    def tile(self, z, stats, *, loss, grad):
        """A tile's `((max, sum exp) | None, slopes exp(z - lse) [M, T] | None)`."""
        part = dz = None
        if loss:
            m = ops.stop_gradient(ops.max(z, axis=1))
            shift = ops.where(m == _NEG_INF, ops.zeros_like(m), m)
            part = (m, ops.sum(ops.exp(z - ops.expand_dims(shift, 1)), axis=1))
        if grad:
            dz = ops.exp(z - ops.expand_dims(stats, 1))
        return part, dz

    def statistics(self, acc):
        """The rows' log-sum-exp (`-inf` for a row without a candidate)."""
        m, s = acc
        return m + ops.log(s)

    def positives(self, z, keep, *, loss, grad):
        """The targets' `(terms, slopes)`: `-z_t / |P|` and `-1 / |P|` (0 where not kept)."""
        weight = -1.0 / _count(keep)
        terms = weight * ops.where(keep, z, ops.zeros_like(z)) if loss else None
        slopes = ops.where(keep, weight, 0.0) if grad else None
        return terms, slopes

    def finish(self, acc, positive_rows, keep, vocab=None):
        """The rows' loss: `lse + sum(terms)`, 0 without a valid target (its `log` kept off 0: no NaN slope)."""
        has = ops.any(keep, axis=1)
        m, s = acc
        lse = ops.where(has, m, 0.0) + ops.log(ops.where(has, s, 1.0))
        return ops.where(has, lse + positive_rows, 0.0)

    def row_scale(self, row_weights, keep, vocab=None):
        return ops.where(ops.any(keep, axis=1), row_weights, 0.0)


def _rescaled(total, m_old, m_new):
    """`total * exp(m_old - m_new)`, 0 for an empty part (`m_old = -inf`, no NaN even when both are)."""
    gap = ops.where(m_old == _NEG_INF, _NEG_INF, m_old - ops.where(m_new == _NEG_INF, 0.0, m_new))
    return total * ops.exp(gap)


def _count(keep):
    return ops.maximum(ops.sum(ops.cast(keep, "float32"), axis=1, keepdims=True), 1.0)


def _masked(z, drop):
    return ops.where(drop, ops.zeros_like(z) + _NEG_INF, z)


def _accidental_hits(safe, keep, negatives):
    """`[M, S]`: negative `s` equals one of row `m`'s kept targets (each occurrence), O(M S) per target."""
    length = safe.shape[-1]
    if length is None:  # a dynamic L: one `[M, L, S]` comparison
        equal = ops.expand_dims(safe, 2) == ops.reshape(negatives, (1, 1, -1))
        return ops.any(ops.logical_and(equal, ops.expand_dims(keep, 2)), axis=1)
    hits = None
    for j in range(length):
        hit = ops.logical_and(ops.expand_dims(safe[:, j], 1) == ops.expand_dims(negatives, 0),
                              keep[:, j : j + 1])
        hits = hit if hits is None else ops.logical_or(hits, hit)
    return hits


def candidate_logits(target_logits, negative_logits, safe, keep, negatives, *, log_q=None,
                     negative_log_q=None, remove_accidental_hits=True, temperature=1.0):
    """`(targets [M, L], negatives [M, S])` float32 logits, scaled, corrected, masked (the module's order).

    `target_logits` are those of `safe` (each row's sorted distinct targets,
    `keep` the valid first ones); `negatives` int32 `[S]`, `EMPTY_ID` for
    padding; `log_q` `[V]` (the targets' correction), `negative_log_q` `[S]`.
    """
    z_t, z_n = ops.cast(target_logits, "float32"), ops.cast(negative_logits, "float32")
    if temperature != 1.0:
        z_t, z_n = z_t / temperature, z_n / temperature
    if log_q is not None:
        z_t = z_t - ops.take(ops.cast(log_q, "float32"), safe, axis=0)
    if negative_log_q is not None:
        z_n = z_n - ops.expand_dims(ops.cast(negative_log_q, "float32"), 0)
    drop = ops.expand_dims(negatives < 0, 0)
    if remove_accidental_hits and safe.shape[-1] != 0:
        drop = ops.logical_or(drop, _accidental_hits(safe, keep, negatives))
    return _masked(z_t, ops.logical_not(keep)), _masked(z_n, drop)


def sampled_softmax_loss(z_t, z_n, keep, family=SampledSoftmax()):
    """The rows' float32 loss `[M]` from `candidate_logits`'s two tiles through `family`."""
    acc = family.init(ops.shape(z_t)[0])
    for z in (z_t, z_n):
        if z.shape[-1] == 0:  # no candidates in this tile (a max has no identity)
            continue
        acc = family.merge(acc, family.tile(z, None, loss=True, grad=False)[0])
    terms, _ = family.positives(z_t, keep, loss=True, grad=False)
    return family.finish(acc, ops.sum(terms, axis=1), keep)


def cut_sampled_softmax(hidden, table, ids, bias, negatives, *, log_q=None, negative_log_q=None,
                        remove_accidental_hits=True, temperature=1.0):
    """The gather kernel (the contract: `keras_cutbce.registry`): only the rows of the targets and `negatives [S]`.

    The negatives' rows are gathered once (`[S, D]`) and scored by one
    matmul; memory O(M (L + S) + S D), never `[M, V]`. Float32 math
    whatever the inputs' dtype.
    """
    vocab = ops.shape(table)[0]
    safe, keep = distinct_targets(ids, vocab)
    h = ops.cast(hidden, "float32")
    z_t = item_logits(h, table, bias, safe)
    neg_safe = ops.where(negatives < 0, ops.zeros_like(negatives), negatives)
    z_n = ops.matmul(h, ops.transpose(ops.cast(ops.take(table, neg_safe, axis=0), "float32")))
    if bias is not None:
        z_n = z_n + ops.expand_dims(ops.cast(ops.take(bias, neg_safe, axis=0), "float32"), 0)
    z_t, z_n = candidate_logits(z_t, z_n, safe, keep, negatives, log_q=log_q,
                                negative_log_q=negative_log_q,
                                remove_accidental_hits=remove_accidental_hits,
                                temperature=temperature)
    return sampled_softmax_loss(z_t, z_n, keep)
