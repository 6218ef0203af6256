"""CutBCE on torch: a `torch.autograd.Function` looping over vocabulary tiles.

The loss of one row is `(1 / V) * sum_v [scale_v softplus(z_v) - target_v z_v]`
with `z = h @ E.T + b` (see `keras_cutbce.coefficients`). Every item gets the
negative weights `(neg_scale, neg_target)`; the positives add a sparse
correction `(delta_scale, delta_target)`. So the work splits in three:

- the dense background `neg_scale * sum_v softplus(z_v)`, tile by tile over
  the vocabulary: one matmul and one `softplus` (one `exp`, one `log1p`) per
  logit in the forward pass; one matmul, one `sigmoid` and two matmuls per
  logit in the backward pass (logits are recomputed, never stored);
- the linear background `neg_target * sum_v z_v = neg_target * (h . sum_v E_v
  + sum_v b_v)`, in closed form (it is non-zero only with label smoothing);
- the positives, a gather of the table rows at the valid, de-duplicated ids.

Only `[M, T]` buffers exist per tile, and one of each is reused for every
tile. Everything runs on the inputs' device in float32 (float64 when an input
is float64), and each gradient comes back in its input's dtype.
"""

import torch
import torch.nn.functional as F

from keras_cutbce.coefficients import bce_coefficients


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    hidden = hidden.float()
    table_tile = table_tile.float()
    if bias_tile is None:
        return hidden @ table_tile.T
    return torch.addmm(bias_tile.float(), hidden, table_tile.T)


def _tile_logits_into(out, hidden, table_tile, bias_tile):
    """Writes the logits of one tile into the preallocated `out` `[M, T]`.

    `hidden` and `out` are already in the compute dtype; the tile is cast if
    the table (or bias) is stored in another dtype.
    """
    table_tile = table_tile.to(out.dtype)
    if bias_tile is None:
        return torch.mm(hidden, table_tile.T, out=out)
    return torch.addmm(bias_tile.to(out.dtype), hidden, table_tile.T, out=out)


def _softplus_threshold(dtype):
    # Above the threshold softplus(z) = z to within exp(-threshold), which is
    # below the dtype's resolution at that magnitude.
    return 40.0 if dtype == torch.float64 else 20.0


def _stable_softplus(z):
    """`softplus(z)`, finite and exact for any finite `z` (one exp, one log1p)."""
    return F.softplus(z, beta=1.0, threshold=_softplus_threshold(z.dtype))


def _compute_dtype(*tensors):
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _capturing(tensor):
    """Whether a CUDA graph capture is running on `tensor`'s device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _positives(ids, vocab_size):
    """Safe item ids `[M, L]` and their 0/1 weights: valid, each id counted once.

    Ids are sorted per row so a repeated id is adjacent to its first
    occurrence; which copy is kept does not matter. Invalid ids (outside
    `[0, V)`) and repeats get weight 0 and point at item 0.
    """
    ids = ids.long()
    ids, _ = torch.sort(ids, dim=1)
    keep = (ids >= 0) & (ids < vocab_size)
    if ids.shape[1] > 1:
        repeat = torch.zeros_like(keep)
        repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
        keep &= ~repeat
    safe = torch.where(keep, ids, torch.zeros_like(ids))
    return safe, keep


def _positive_logits(hidden, table, bias, safe, dtype):
    """Rows of the table at `safe` `[M, L, D]` and their logits `[M, L]`."""
    rows = table[safe].to(dtype)
    z = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        z = z + bias[safe].to(dtype)
    return rows, z


class _CutBCEFunction(torch.autograd.Function):
    """Per-row CutBCE loss with exact, tile-by-tile gradients for any cotangent."""

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, coef, chunk_size):
        dtype = _compute_dtype(hidden, table, bias)
        num_rows = hidden.shape[0]
        vocab_size = table.shape[0]
        h = hidden.to(dtype)
        threshold = _softplus_threshold(dtype)

        # Dense background: sum_v softplus(z_v), one reused [M, T] buffer.
        width = max(1, min(chunk_size, vocab_size))
        storage = torch.empty(num_rows * width, dtype=dtype, device=hidden.device)
        ones = torch.ones(width, dtype=dtype, device=hidden.device)
        softplus_sum = torch.zeros(num_rows, dtype=dtype, device=hidden.device)
        for start in range(0, vocab_size, width):
            stop = min(start + width, vocab_size)
            z = storage[: num_rows * (stop - start)].view(num_rows, stop - start)
            _tile_logits_into(
                z, h, table[start:stop], None if bias is None else bias[start:stop]
            )
            torch.ops.aten.softplus.out(z, 1.0, threshold, out=z)
            softplus_sum.addmv_(z, ones[: stop - start])
        loss = coef.neg_scale * softplus_sum

        # Linear background: sum_v z_v in closed form.
        if coef.neg_target != 0.0:
            logit_sum = torch.mv(h, table.sum(0, dtype=dtype))
            if bias is not None:
                logit_sum += bias.sum(dtype=dtype)
            loss -= coef.neg_target * logit_sum

        # Positives: sparse correction.
        if ids.shape[1] > 0:
            safe, keep = _positives(ids, vocab_size)
            _, zp = _positive_logits(h, table, bias, safe, dtype)
            terms = coef.delta_scale * _stable_softplus(zp) - coef.delta_target * zp
            loss += (terms * keep).sum(1)

        loss /= vocab_size
        ctx.save_for_backward(hidden, table, bias, ids)
        ctx.coef = coef
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, table, bias, ids = ctx.saved_tensors
        need_h, need_e, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_e or need_b):
            return None, None, None, None, None, None
        coef = ctx.coef
        dtype = _compute_dtype(hidden, table, bias)
        device = hidden.device
        vocab_size = table.shape[0]
        h = hidden.to(dtype)
        g = grad_loss.to(dtype) / vocab_size
        # Rows with a zero cotangent (masked or padded positions) add nothing:
        # drop them before the tile loop, scatter grad_hidden back at the end.
        # (Not while a CUDA graph is being captured: counting them syncs.)
        active_rows = None
        if not _capturing(g):
            active = g != 0
            if int(active.sum()) < g.shape[0]:
                active_rows = active.nonzero().squeeze(1)
                h, g, ids = h[active_rows], g[active_rows], ids[active_rows]
        num_rows, dim = h.shape
        # Row weight of the dense term: dZ = (g / V) * neg_scale * sigmoid(z).
        row_weight = g * coef.neg_scale

        grad_h = torch.zeros(num_rows, dim, dtype=dtype, device=device) if need_h else None
        grad_e = torch.empty(vocab_size, dim, dtype=dtype, device=device) if need_e else None
        grad_b = torch.empty(vocab_size, dtype=dtype, device=device) if need_b else None
        weighted_h = row_weight[:, None] * h if need_e else None

        width = max(1, min(ctx.chunk_size, vocab_size))
        storage = torch.empty(num_rows * width, dtype=dtype, device=device)
        for start in range(0, vocab_size, width):
            stop = min(start + width, vocab_size)
            table_tile = table[start:stop].to(dtype)
            z = storage[: num_rows * (stop - start)].view(num_rows, stop - start)
            _tile_logits_into(z, h, table_tile, None if bias is None else bias[start:stop])
            s = z.sigmoid_()
            if need_h:
                grad_h.addmm_(s, table_tile)
            if need_e:
                torch.mm(s.T, weighted_h, out=grad_e[start:stop])
            if need_b:
                torch.mv(s.T, row_weight, out=grad_b[start:stop])
        if need_h:
            grad_h *= row_weight[:, None]

        # Linear background: d/dz of -neg_target * z is the constant -neg_target.
        if coef.neg_target != 0.0:
            const = g * coef.neg_target
            if need_h:
                grad_h.addr_(const, table.sum(0, dtype=dtype), alpha=-1.0)
            if need_e:
                grad_e -= (const @ h)[None, :]
            if need_b:
                grad_b -= const.sum()

        # Positives: dz = (g / V) * (delta_scale * sigmoid(z) - delta_target).
        if ids.shape[1] > 0:
            safe, keep = _positives(ids, vocab_size)
            rows, zp = _positive_logits(h, table, bias, safe, dtype)
            dz = (coef.delta_scale * torch.sigmoid(zp) - coef.delta_target) * keep
            dz *= g[:, None]
            flat = safe.reshape(-1)
            if need_h:
                grad_h += torch.bmm(dz.unsqueeze(1), rows).squeeze(1)
            if need_e:
                grad_e.index_add_(0, flat, (dz.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, dim))
            if need_b:
                grad_b.index_add_(0, flat, dz.reshape(-1))

        if need_h and active_rows is not None:
            grad_h = torch.zeros(
                hidden.shape, dtype=dtype, device=device
            ).index_copy_(0, active_rows, grad_h)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_e is None else grad_e.to(table.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size):
    """Per-row binary cross-entropy over the whole vocabulary, tile by tile.

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
        chunk_size: positive int, the width of a vocabulary tile.

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
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be a positive int; received {chunk_size!r}.")
    coef = bce_coefficients(label_smoothing, pos_weight)
    ids = torch.as_tensor(ids, device=hidden.device)
    if ids.ndim == 1:
        ids = ids[:, None]
    return _CutBCEFunction.apply(hidden, table, bias, ids, coef, chunk_size)
