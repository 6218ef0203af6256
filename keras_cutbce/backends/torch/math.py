"""torch's loss families (`BCE`, `Softmax`) and BCE's per-logit helpers (as `backends/jax/math.py`).

The protocol's methods, plus in-place variants: `out=` buffers instead of a
shared `exp(-|z|)` (a `softplus(z)`-only term runs the stock `softplus` /
`sigmoid` kernels, one pass each over `[M, T]`) and `acc=` in `tile`.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


def compute_dtype(*tensors):
    """float32, or float64 when an input is float64: the dtype the kernels compute in."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _softplus_threshold(dtype):
    # Above the threshold softplus(z) = z to within exp(-threshold), which is
    # below the dtype's resolution at that magnitude.
    return 40.0 if dtype == torch.float64 else 20.0


def _softplus(z, out=None):
    threshold = _softplus_threshold(z.dtype)
    if out is None:
        return F.softplus(z, 1.0, threshold)
    return torch.ops.aten.softplus.out(z, 1.0, threshold, out=out)


def terms(z, minus, plus, *, out=None):
    """`minus * softplus(-z) + plus * softplus(z)`, a 0 weight's part left out; `out`: used when `minus` is 0."""
    if minus == 0.0:
        result = _softplus(z, out)
        return result if plus == 1.0 else result.mul_(plus)
    log_part = torch.log1p(torch.exp(-z.abs()))
    result = minus * ((-z).clamp_min(0.0) + log_part)
    if plus != 0.0:
        result = result + plus * (z.clamp_min(0.0) + log_part)
    return result


def slopes(z, minus, plus, *, out=None):
    """`plus * sigmoid(z) - minus * sigmoid(-z)` with one sigmoid; `out` may be `z` itself."""
    total = plus + minus
    if minus >= plus:
        result = torch.sigmoid(-z, out=out) if out is not None else torch.sigmoid(-z)
        result = result.mul_(-total)
        return result if plus == 0.0 else result.add_(plus)
    result = torch.sigmoid(z, out=out) if out is not None else torch.sigmoid(z)
    if total != 1.0:
        result = result.mul_(total)
    return result if minus == 0.0 else result.sub_(minus)


class BCE(NamedTuple):
    """Binary cross-entropy as a loop's loss family (the protocol: docs/development.md).

    The tiles sum `softplus(z)` alone (the stock kernel): `finish` and
    `row_scale` apply `neg_scale`, and the loop adds `-linear * sum_v z_v`
    (`linear = neg_target`) in closed form.
    """

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False

    @property
    def linear(self):
        return self.coef.neg_target

    def init(self, rows, *, dtype=torch.float32, device=None):
        return torch.zeros(rows, dtype=dtype, device=device)

    def merge(self, acc, part, *, out=None):
        return torch.add(acc, part, out=out)

    def tile(self, z, stats, *, loss, grad, acc=None, out=None):
        """A tile's `(row part | None, slopes | None)`; a positive's `-inf` adds 0.

        `acc`: the part added into it in place; `out`: the `[M, T]` buffer of the
        terms (with `loss`) or else of the slopes (`z` itself: written over).
        """
        part = dz = None
        if loss:
            part = terms(z, 0.0, 1.0, out=out).sum(1)
            part = part if acc is None else acc.add_(part)
        if grad:
            dz = slopes(z, 0.0, 1.0, out=None if loss else out)
        return part, dz

    def statistics(self, acc):
        return None  # the slopes need no row statistics

    def positives(self, z, keep, *, loss, grad):
        """Each positive's `(term, slope)` (or None), with `linear * z` taken back out."""
        term = slope = None
        if loss:
            term = terms(z, *self.coef.positive_weights)
            if self.linear != 0.0:
                term = term + self.linear * z
        if grad:
            slope = slopes(z, *self.coef.positive_weights)
            if self.linear != 0.0:
                slope = slope + self.linear
        return term, slope

    def finish(self, acc, positive_rows, keep, vocab):
        return (self.coef.neg_scale * acc + positive_rows) / vocab

    def row_scale(self, row_weights, keep, vocab):
        inv_v = 1.0 / vocab
        return row_weights * (self.coef.neg_scale * inv_v), row_weights * inv_v


class Softmax(NamedTuple):
    """Softmax cross-entropy as a loop's loss family: a `[2, M]` running `(max, sum exp)`; `linear = a / V`."""

    label_smoothing: float
    vocab: int

    masks_positives = False
    two_pass = True

    @property
    def linear(self):
        return self.label_smoothing / self.vocab

    def init(self, rows, *, dtype=torch.float32, device=None):
        acc = torch.zeros(2, rows, dtype=dtype, device=device)
        acc[0].fill_(float("-inf"))  # (item assignment makes a tensor of the number first)
        return acc

    def merge(self, acc, part, *, out=None):
        top = torch.maximum(acc[0], part[0])
        shift = _shift(top)
        total = acc[1] * torch.exp(acc[0] - shift) + part[1] * torch.exp(part[0] - shift)
        if out is None:
            return torch.stack([top, total])
        out[1] = total
        out[0] = top
        return out

    def tile(self, z, stats, *, loss, grad, acc=None, out=None):
        """A tile's `((max, sum exp) | None, slopes | None)`; `acc`, `out`: as `BCE.tile`."""
        part = dz = None
        if loss:
            # Three passes over the `[M, T]` tile (max, shifted exp in place, row sum);
            # the rest is `[M]` vectors.
            part = self.init(z.shape[0], dtype=z.dtype, device=z.device) if acc is None else acc
            top = torch.maximum(part[0], z.amax(1))
            shift = _shift(top)
            part[1].mul_(part[0].sub_(shift).exp_())
            part[1].add_(torch.sub(z, shift[:, None], out=out).exp_().sum(1))
            part[0].copy_(top)
        if grad:
            dz = torch.sub(z, stats[:, None], out=None if loss else out).exp_()
        return part, dz

    def statistics(self, acc):
        return acc[0] + torch.log(acc[1])

    def positives(self, z, keep, *, loss, grad):
        """The positives' `(terms, slopes)`: `-(1 - a) / |P| z_p` and its slope."""
        weight = -(1.0 - self.label_smoothing) / keep.sum(1, keepdim=True).clamp_min(1).to(z.dtype)
        return (weight * z if loss else None), (weight.expand_as(z) if grad else None)

    def finish(self, acc, positive_rows, keep, vocab):
        return torch.where(_has_target(keep), self.statistics(acc) + positive_rows, 0.0)

    def row_scale(self, row_weights, keep, vocab):
        scale = torch.where(_has_target(keep), row_weights, 0.0)
        return scale, scale


def _shift(top):
    # The shift is the new max; 0 stands in for it while a row is all `-inf` (items masked by
    # their bias), so `exp(-inf - shift)` is 0, not NaN.
    return top.masked_fill(top == float("-inf"), 0.0)


def _has_target(keep):
    if keep is None:  # no id slots
        return torch.zeros((), dtype=torch.bool)
    return keep.any(1)
