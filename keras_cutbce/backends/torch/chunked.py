"""CutBCE on torch: the `torch.autograd.Function`s and the kernel entry points.

`cut_bce` (per-row loss, any cotangent) runs a loss pass forward and a
gradient pass backward; `cut_bce_weighted_sum` (the fused training path of
a reduced loss: the row weights are constants, so the gradient for any
upstream scalar cotangent is a multiple of the gradient at 1) computes the
loss and the gradients in one pass over the tiles, and its backward pass
only scales them. Both run `keras_cutbce.backends.torch.kernel` (the tile
loop; its element-wise math is `keras_cutbce.backends.torch.math`).

What is torch's own here: the autograd mechanism (`torch.autograd.Function`,
only the gradients that are needed, none under `torch.no_grad`) and rows
with a zero cotangent masked (their hidden row zeroed, so they add exactly 0
whatever they held). Nothing on the per-call path reads a device value on
the host: no device-to-host sync on CUDA, no graph break under
`torch.compile` and nothing that a CUDA graph capture could not record.
The public op (`keras_cutbce.ops`) has checked every argument: these entry
points assert, never re-check. Each gradient comes back in its input's
dtype.
"""

import torch
from torch.autograd.function import once_differentiable

from keras_cutbce.backends.torch import kernel
from keras_cutbce.backends.torch import math
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.math.coefficients import bce_coefficients


def mask_zero_rows(weight, hidden):
    """Returns `hidden` with the rows whose weight is zero set to zero.

    A zero-weight row then adds exactly 0 to the loss and to every gradient,
    even where its hidden row is not finite, and its hidden gradient is
    exactly 0. The rows are masked, not dropped: dropping them would need
    their count on the host.

    Example:

    >>> mask_zero_rows(torch.tensor([1.0, 0.0]), torch.full((2, 1), float("nan"))).isnan().tolist()
    [[True], [False]]
    """
    return torch.where((weight != 0)[:, None], hidden, torch.zeros((), dtype=hidden.dtype))


def _cast(grad, like):
    return None if grad is None else grad.to(like.dtype)


class _CutBCEFunction(torch.autograd.Function):
    """Per-row CutBCE loss with exact, tile-by-tile gradients for any cotangent."""

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, family, tile, dense):
        dtype = compute_dtype(hidden, table, bias)
        loss, _, _, _ = kernel.row_losses(hidden.to(dtype), table, bias, ids, family, tile, dense=dense)
        ctx.save_for_backward(hidden, table, bias, ids)
        ctx.family = family
        ctx.tile = tile
        ctx.dense = dense
        return loss

    @staticmethod
    def backward(ctx, row_scale):
        hidden, table, bias, ids = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        if not any(need):
            return (None,) * 7
        dtype = compute_dtype(hidden, table, bias)
        # Rows with a zero cotangent (masked or padded positions) add nothing.
        row_scale = row_scale.to(dtype)
        h = mask_zero_rows(row_scale, hidden.to(dtype))
        grad_h, grad_e, grad_b = kernel.row_gradients(
            h, table, bias, ids, ctx.family, ctx.tile, row_scale, need, dense=ctx.dense
        )
        grads = _cast(grad_h, hidden), _cast(grad_e, table), _cast(grad_b, bias)
        return grads + (None,) * 4


class _CutBCEWeightedSumFunction(torch.autograd.Function):
    """`sum_m w_m * loss_m` whose gradients are computed in the forward pass.

    The row weights are constants, so the gradient for an upstream scalar
    cotangent `c` is `c` times the gradient at `c = 1`: the forward pass
    computes it along with the loss (one logits matmul per tile instead of
    two) and the backward pass only scales it, in place, so the `[V, D]`
    table gradient exists once, not twice. A later backward through the same
    graph (`retain_graph=True`, e.g. `gradcheck`) recomputes them.
    """

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, row_weights, family, tile, need, dense):
        loss, *grads = _fused_pass(hidden, table, bias, ids, row_weights, family, tile, need, dense)
        # Held on `ctx`, not saved: the first backward pass consumes them.
        ctx.fused_grads = grads
        ctx.save_for_backward(hidden, table, bias, ids, row_weights)
        ctx.family, ctx.tile, ctx.need, ctx.dense = family, tile, need, dense
        ctx.dtypes = (hidden.dtype, table.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, cotangent):
        grads, ctx.fused_grads = ctx.fused_grads, None
        if grads is None:  # a second backward: the first one consumed them
            _, *grads = _fused_pass(*ctx.saved_tensors, ctx.family, ctx.tile, ctx.need, ctx.dense)
        # Always scaled (a cotangent of 1 scales exactly): comparing it with
        # 1 first would read it on the host.
        scaled = []
        for grad, dtype in zip(grads, ctx.dtypes):
            if grad is not None:
                grad = grad.mul_(cotangent.to(grad.dtype)).to(dtype)
            scaled.append(grad)
        return tuple(scaled) + (None,) * 6


def _fused_pass(hidden, table, bias, ids, row_weights, family, tile, need, dense):
    """Returns the weighted loss sum and the needed gradients at cotangent 1."""
    dtype = compute_dtype(hidden, table, bias)
    w = row_weights.to(dtype)
    h = mask_zero_rows(w, hidden.to(dtype))
    loss, grad_h, grad_e, grad_b = kernel.row_losses(
        h, table, bias, ids, family, tile, w, need, dense=dense
    )
    return torch.dot(w, loss), grad_h, grad_e, grad_b


def _tile(chunk_size):
    """The tile width: `chunk_size` as the public op checked it (a positive int)."""
    assert isinstance(chunk_size, int) and not isinstance(chunk_size, bool), chunk_size
    assert chunk_size > 0, chunk_size
    return chunk_size


def _as_ids(ids, device):
    ids = torch.as_tensor(ids, device=device)
    return ids[:, None] if ids.ndim == 1 else ids


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size):
    """Computes the per-row binary cross-entropy over the whole vocabulary, tile by tile.

    Never builds the `[M, V]` logits: memory is O(M * chunk_size + V * D).
    Gradients for `hidden`, `table` and `bias` are exact for any cotangent;
    only those that are needed are computed, and none under `torch.no_grad`.

    Args:
        hidden: float `[M, D]` (float32, bfloat16, float16 or float64).
        table: float `[V, D]` item table.
        ids: integer `[M, L]` target ids (any integer dtype, `L` may be 0).
            Ids outside `[0, V)` are padding; repeated ids in a row count once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: positive int, the width of a vocabulary tile (checked by
            the public op).

    Returns:
        Float32 loss `[M]` (float64 if an input is float64).

    Example:

    >>> h = torch.randn(4, 8)
    >>> table = torch.randn(100, 8, requires_grad=True)
    >>> ids = torch.tensor([[1, 2], [3, -1], [5, 5], [7, 99]])
    >>> loss = cut_bce(h, table, ids, chunk_size=32)
    >>> loss.shape
    torch.Size([4])
    >>> loss.sum().backward(); table.grad.shape
    torch.Size([100, 8])
    """
    return run_cut_bce(kernel.dense_pass, hidden, table, ids, bias, label_smoothing=label_smoothing,
                       pos_weight=pos_weight, tile=_tile(chunk_size))


def run_cut_bce(dense, hidden, table, ids, bias, *, label_smoothing, pos_weight, tile):
    """`cut_bce` with `dense` computing the background (`kernel.dense_pass`'s signature)."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _per_row(dense, hidden, table, ids, bias, family, tile)


def _per_row(dense, hidden, table, ids, bias, family, tile):
    ids = _as_ids(ids, hidden.device)
    return _CutBCEFunction.apply(hidden, table, bias, ids, family, tile, dense)


def cut_bce_weighted_sum(
    hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight, chunk_size
):
    """Computes `sum_m row_weights[m] * cut_bce(...)[m]`, with its gradients fused in.

    What a reduced loss needs (sample weights, masks and the reduction's
    divisor are the row weights, constants without gradient). When a
    gradient is needed, the one pass over the vocabulary tiles that computes
    the loss also computes the gradients of `hidden`, `table` and `bias`
    (only those that require grad): per tile, one logits matmul, one
    `softplus` and one `sigmoid` over the `[M, T]` logits, then one product
    per gradient. The backward pass only scales them by the upstream
    cotangent. Rows with a zero weight add exactly 0. Without gradients (under
    `torch.no_grad` or when no input requires grad) only the loss is
    computed.

    Args:
        hidden: float `[M, D]` (float32, bfloat16, float16 or float64).
        table: float `[V, D]` item table.
        ids: integer `[M, L]` target ids (any integer dtype, `L` may be 0).
            Ids outside `[0, V)` are padding; repeated ids in a row count once.
        bias: float `[V]` or None.
        row_weights: float `[M]` weights of the rows (no gradient flows to them).
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: positive int, the width of a vocabulary tile (checked by
            the public op).

    Returns:
        Float32 scalar (float64 if an input is float64); gradients come back
        in each input's dtype.

    Example:

    >>> h = torch.randn(4, 8, requires_grad=True)
    >>> table = torch.randn(100, 8, requires_grad=True)
    >>> ids = torch.tensor([[1, 2], [3, -1], [5, 5], [7, 99]])
    >>> w = torch.tensor([0.25, 0.25, 0.0, 0.5])
    >>> total = cut_bce_weighted_sum(h, table, ids, None, w, label_smoothing=0.0,
    ...                              pos_weight=1.0, chunk_size=32)
    >>> per_row = cut_bce(h, table, ids, chunk_size=32)
    >>> torch.allclose(total, (w * per_row).sum())
    True
    >>> total.backward(); h.grad[2].abs().max().item()
    0.0
    """
    return run_weighted_sum(kernel.dense_pass, hidden, table, ids, bias, row_weights,
                            label_smoothing=label_smoothing, pos_weight=pos_weight,
                            tile=_tile(chunk_size))


def run_weighted_sum(dense, hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight,
                     tile):
    """`cut_bce_weighted_sum` with `dense` computing the background (as `run_cut_bce`)."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return _weighted_sum(dense, hidden, table, ids, bias, row_weights, family, tile)


def _weighted_sum(dense, hidden, table, ids, bias, row_weights, family, tile):
    ids = _as_ids(ids, hidden.device)
    row_weights = torch.as_tensor(row_weights, device=hidden.device).detach().reshape(-1)
    need = (
        hidden.requires_grad,
        table.requires_grad,
        bias is not None and bias.requires_grad,
    )
    if torch.is_grad_enabled() and any(need):
        return _CutBCEWeightedSumFunction.apply(
            hidden, table, bias, ids, row_weights, family, tile, need, dense
        )
    with torch.no_grad():
        dtype = compute_dtype(hidden, table, bias)
        w = row_weights.to(dtype)
        h = mask_zero_rows(w, hidden.to(dtype))
        loss, _, _, _ = kernel.row_losses(h, table, bias, ids, family, tile, dense=dense)
        return torch.dot(w, loss)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size):
    """Computes the per-row softmax cross-entropy over the full vocabulary, tile by tile.

    The loop of `cut_bce` with the `math.Softmax` family (two passes over
    the tiles when a gradient is needed: the rows' log-sum-exp, then the
    slopes). Arguments as `cut_bce`'s, without `pos_weight`.

    Returns:
        Float32 loss `[M]` (float64 if an input is float64); 0 for a row
        without a valid id.

    Example:

    >>> z = torch.tensor([[1.0, 2.0, 1.0]]).log()
    >>> round(cut_softmax(z, torch.eye(3), torch.tensor([[1]]), chunk_size=2).item(), 4)
    0.6931
    """
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return _per_row(kernel.dense_pass, hidden, table, ids, bias, family, _tile(chunk_size))


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing,
                             chunk_size):
    """Computes `sum_m row_weights[m] * cut_softmax(...)[m]`, its gradients computed with it.

    As `cut_bce_weighted_sum`, with the `math.Softmax` family.
    """
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return _weighted_sum(kernel.dense_pass, hidden, table, ids, bias, row_weights, family,
                         _tile(chunk_size))
