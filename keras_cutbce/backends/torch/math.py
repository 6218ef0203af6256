"""The element-wise math of the torch kernels: one loss term and one slope.

`terms(z, minus, plus)` is `minus * softplus(-z) + plus * softplus(z)` and
`slopes(z, minus, plus)` its derivative `plus * sigmoid(z) - minus *
sigmoid(-z)` (`keras_cutbce.math.coefficients` gives the weights of a
negative and of a positive; `keras_cutbce.math.spec` is the float64 table
they are tested against). Every torch pass calls these two.

What is torch's own: a term with only `softplus(z)` (what the dense tiles
run) goes through the stock `softplus` / `sigmoid` kernels, each one pass
over `[M, T]`, and can write into a preallocated `out=` buffer (the tile
loop reuses one buffer for every tile). Sharing one `exp(-|z|)` between
them would take more separate torch kernels, so more passes, than the
second exponential costs.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


def compute_dtype(*tensors):
    """Returns float32, or float64 when an input is float64: the dtype the kernels compute in.

    Example:

    >>> compute_dtype(torch.zeros(2, dtype=torch.bfloat16), None)
    torch.float32
    """
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
    """Returns `minus * softplus(-z) + plus * softplus(z)`, per logit.

    A part whose weight is 0 is left out, so `z = -inf` with `minus = 0`
    gives exactly 0 (how the tile loop skips a positive). Otherwise both
    parts share one `log1p(exp(-|z|))`: `minus * (max(-z, 0) + log_part) +
    plus * (max(z, 0) + log_part)`, each non-negative, finite for any
    finite `z`.

    Args:
        z: float logits, any shape.
        minus: Python float, the weight of `softplus(-z)`.
        plus: Python float, the weight of `softplus(z)`.
        out: optional buffer of `z`'s shape and dtype for the result (used
            only when `minus` is 0, by the stock `softplus`); not `z` itself.

    Returns:
        A tensor like `z` (`out` when given and used).

    Example:

    >>> terms(torch.tensor([-float("inf"), 0.0, 100.0]), 0.0, 1.0).tolist()
    [0.0, 0.6931471824645996, 100.0]
    >>> terms(torch.tensor([-100.0, 100.0]), 1.0, 0.0)[1].item() > 0.0
    True
    """
    if minus == 0.0:
        result = _softplus(z, out)
        return result if plus == 1.0 else result.mul_(plus)
    log_part = torch.log1p(torch.exp(-z.abs()))
    result = minus * ((-z).clamp_min(0.0) + log_part)
    if plus != 0.0:
        result = result + plus * (z.clamp_min(0.0) + log_part)
    return result


def slopes(z, minus, plus, *, out=None):
    """Returns `plus * sigmoid(z) - minus * sigmoid(-z)`, the `d/dz` of `terms`.

    With one sigmoid, that of the larger weight's side: `plus - (plus +
    minus) * sigmoid(-z)` when `minus >= plus`, else `(plus + minus) *
    sigmoid(z) - minus`. So a weight of 0 drops its part exactly, and the
    result is exact to float32 resolution at any `z` (a negative's
    `sigmoid(-30) ~ 9e-14` is not lost as `1 - sigmoid(30)` would lose it).

    Args:
        z: float logits, any shape.
        minus: Python float, the weight of `sigmoid(-z)`.
        plus: Python float, the weight of `sigmoid(z)`.
        out: optional buffer for the sigmoid; may be `z` itself (the tile
            loop's in-place sigmoid).

    Returns:
        A tensor like `z`.

    Example:

    >>> slopes(torch.tensor([-float("inf"), 0.0]), 1.0, 0.0).tolist()
    [-1.0, -0.5]
    >>> f"{slopes(torch.tensor([-30.0]), 0.0, 1.0).item():.4e}"
    '9.3576e-14'
    """
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
    """Binary cross-entropy as the torch loop's loss family (the seam: docs/development.md).

    The loop (`kernel`) is given a family: the rows' reduction over the tiles
    (`init`, then `tile` adds a tile's dense terms in place), the dense
    slopes (`slopes`, in place), the weight of the closed-form linear
    background `-sum_v z_v` (`linear`), each positive's term and slope
    (`positives`), the rows' loss (`finish`) and the factors of each row's
    dense and sparse slopes (`row_scales`). As in JAX's
    `math.BCE`: `masks_positives` (the tiles skip the positives, added
    exactly by `positives`) and `two_pass` (the slopes need a first pass's
    row statistics).
    """

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    masks_positives = True
    two_pass = False

    @property
    def linear(self):
        return self.coef.neg_target

    def init(self, rows, dtype, device):
        """The rows' reduction before the first tile: `[M]` zeros (the sums of `softplus(z)`)."""
        return torch.zeros(rows, dtype=dtype, device=device)

    def tile(self, z, acc, stats, *, out, ones):
        """Adds the tile's `softplus(z)` (0 at a positive's `-inf`) to the rows' sums `acc`."""
        acc.addmv_(terms(z, 0.0, 1.0, out=out), ones)

    def slopes(self, z, stats):
        """Returns the tile's slopes `sigmoid(z)`, written over `z`."""
        return slopes(z, 0.0, 1.0, out=z)

    def positives(self, z, keep, *, loss, grad):
        """Returns each positive's `(term, slope)` (or None), with `linear * z` taken back out."""
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

    def finish(self, acc, sparse, positives, vocab):
        """Returns the rows' loss: the mean over the vocabulary."""
        return (self.coef.neg_scale * acc + sparse) / vocab

    def row_scales(self, row_weights, positives, vocab):
        """Returns the factors of each row's dense and sparse slopes: its weight over `V`."""
        inv_v = 1.0 / vocab
        return row_weights * (self.coef.neg_scale * inv_v), row_weights * inv_v


class Softmax(NamedTuple):
    """Softmax cross-entropy as the torch loop's loss family (the seam: docs/development.md).

    The math of JAX's `math.Softmax`. The rows' running value is a `[2, M]`
    tensor `(max, sum exp(z - max))`, updated in place tile by tile; the
    label smoothing's `-(a / V) sum_v z_v` is the loop's closed-form linear
    background (`linear = a / V`), so the dense slopes are `exp(z - lse)`
    alone, written over `z`.
    """

    label_smoothing: float
    vocab: int

    masks_positives = False
    two_pass = True

    @property
    def linear(self):
        return self.label_smoothing / self.vocab

    def init(self, rows, dtype, device):
        """`(max, sum exp)` before the first tile: `[2, M]`, `(-inf, 0)`."""
        acc = torch.zeros(2, rows, dtype=dtype, device=device)
        acc[0] = float("-inf")
        return acc

    def tile(self, z, acc, stats, *, out, ones):
        """Merges the tile into the running `(max, sum exp)` `acc`, in place."""
        top = torch.maximum(acc[0], z.amax(1))
        # `exp(old max - new max)`; the first tile's `-inf - finite` gives 0.
        acc[1].mul_(torch.exp(acc[0] - top).nan_to_num_(nan=0.0))
        acc[1].addmv_(torch.exp(torch.sub(z, top[:, None], out=out), out=out), ones)
        acc[0] = top

    def statistics(self, acc):
        """The rows' log-sum-exp `[M]`."""
        return acc[0] + torch.log(acc[1])

    def slopes(self, z, stats):
        """Returns the tile's `softmax(z)`, written over `z`."""
        return z.sub_(stats[:, None]).exp_()

    def positives(self, z, keep, *, loss, grad):
        """Returns the positives' `(terms, slopes)`: `-(1 - a) / |P| z_p` and its slope."""
        weight = -(1.0 - self.label_smoothing) / keep.sum(1, keepdim=True).clamp_min(1).to(z.dtype)
        return (weight * z if loss else None), (weight.expand_as(z) if grad else None)

    def finish(self, acc, sparse, positives, vocab):
        """Returns the rows' loss, 0 for a row without a valid id."""
        return torch.where(_has_target(positives), self.statistics(acc) + sparse, 0.0)

    def row_scales(self, row_weights, positives, vocab):
        """Returns the factors of each row's dense and sparse slopes: its weight, 0 without a valid id."""
        scale = torch.where(_has_target(positives), row_weights, 0.0)
        return scale, scale


def _has_target(positives):
    """Whether each row has a valid id, `[M]` bool."""
    if positives.empty:
        return torch.zeros((), dtype=torch.bool)
    return positives.keep.any(1)
