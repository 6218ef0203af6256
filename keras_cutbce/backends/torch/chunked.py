"""CutBCE on torch: a `torch.autograd.Function` looping over vocabulary tiles.

The loss of one row is `(1 / V) * sum_v [scale_v softplus(z_v) - target_v z_v]`
with `z = h @ E.T + b` (see `keras_cutbce.math.coefficients`). The negatives get
the weights `(neg_scale, neg_target)`; the positives their exact,
cancellation-free term `pos_minus softplus(-z) + pos_plus softplus(z)`. So
the work splits in three:

- the dense background `neg_scale * sum_v softplus(z_v)` over the negatives,
  tile by tile over the vocabulary: one matmul and one `softplus` (one `exp`,
  one `log1p`) per logit in the forward pass; one matmul, one `sigmoid` and
  two matmuls per logit in the backward pass (logits are recomputed, never
  stored). The row's positives are set to `-inf` in each tile's logits (an
  O(M L) `index_fill_` over the whole call, see `_TilePositives`), where
  `softplus` and `sigmoid` are exactly 0: never added and subtracted back,
  so a saturated positive keeps full precision;
- the linear background `neg_target * sum_v z_v = neg_target * (h . sum_v E_v
  + sum_v b_v)`, in closed form (it is non-zero only with label smoothing),
  with the positives' `z` taken back out;
- the positives, a gather of the table rows at the valid, de-duplicated ids
  (`keras_cutbce.math.positives.distinct_targets`).

`cut_bce_weighted_sum` is the fused training path of a reduced loss: the
row weights are constants, so the gradient for any upstream cotangent is a
multiple of the gradient at 1, and the forward pass computes it in the same
pass over the tiles as the loss (one matmul, one `softplus`, one `sigmoid`
and one matmul per needed gradient per logit); the backward pass only scales
it. Both paths share one tile loop (`_dense_pass`) and one closed-form part
(`_sparse_terms`).

Only `[M, T]` buffers exist per tile, and one of each is reused for every
tile. Everything runs on the inputs' device in float32 (float64 when an input
is float64), and each gradient comes back in its input's dtype.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.coefficients import bce_coefficients


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

    `keras_cutbce.math.positives.distinct_targets` (sort-based, O(M L)):
    invalid ids (outside `[0, V)`) and repeats get weight 0 and point at
    item 0.
    """
    safe, keep = distinct_targets(ids, vocab_size)
    return safe.long(), keep


class _TilePositives:
    """Where each tile's positives sit in its `[M, T]` buffer, to mask them out.

    The kept positives `(row, id)` are sorted by id once; a tile
    `[start, stop)` then owns one contiguous slice of them (one
    `searchsorted` for all tile bounds, one host sync per call), and
    `flat(start, stop)` gives their flat offsets `row * (stop - start) + id -
    start` in the tile's buffer. O(M L) in all.
    """

    def __init__(self, ids, vocab_size, width):
        self.empty = ids is None or ids.shape[1] == 0
        if self.empty:
            return
        safe, keep = _positives(ids, vocab_size)
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(safe)
        item, order = torch.sort(safe[keep])
        self.items, self.rows = item, rows[keep][order]
        bounds = torch.arange(0, vocab_size + width, width, device=ids.device).clamp_(max=vocab_size)
        self.bounds = torch.searchsorted(item, bounds).tolist()
        self.width = width

    def flat(self, start, stop):
        """Flat offsets of the tile's positives in a contiguous `[M, stop - start]` buffer."""
        if self.empty:
            return None
        tile = start // self.width
        lo, hi = self.bounds[tile], self.bounds[tile + 1]
        if lo == hi:
            return None
        return self.rows[lo:hi] * (stop - start) + (self.items[lo:hi] - start)


def _positive_terms(z, coef):
    """A positive's exact term `pos_minus softplus(-z) + pos_plus softplus(z)` (no cancellation)."""
    log_part = torch.log1p(torch.exp(-z.abs()))
    out = coef.pos_minus * ((-z).clamp_min(0.0) + log_part)
    if coef.pos_plus != 0.0:
        out = out + coef.pos_plus * (z.clamp_min(0.0) + log_part)
    return out


def _positive_slopes(z, coef):
    """`d/dz` of `_positive_terms`: `pos_plus sigmoid(z) - pos_minus sigmoid(-z)`.

    Written `pos_plus - (pos_plus + pos_minus) sigmoid(-z)` (one sigmoid):
    exact to float32 resolution of the result at any `z`.
    """
    out = -(coef.pos_plus + coef.pos_minus) * torch.sigmoid(-z)
    return out if coef.pos_plus == 0.0 else out + coef.pos_plus


def _positive_logits(hidden, table, bias, safe, dtype):
    """Rows of the table at `safe` `[M, L, D]` and their logits `[M, L]`."""
    rows = table[safe].to(dtype)
    z = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        z = z + bias[safe].to(dtype)
    return rows, z


def _drop_zero_rows(weight, *row_tensors):
    """Drops the rows whose weight is zero: they add nothing to a weighted sum.

    Returns `(active_rows, weight, *row_tensors)`, where `active_rows` is
    `None` when every row is kept. Counting the active rows syncs with the
    device, so nothing is dropped while a CUDA graph is being captured.
    """
    if not _capturing(weight):
        active = weight != 0
        if int(active.sum()) < weight.shape[0]:
            rows = active.nonzero().squeeze(1)
            return (rows, weight[rows]) + tuple(t[rows] for t in row_tensors)
    return (None, weight) + row_tensors


def _scatter_rows(values, active_rows, num_rows):
    """`values` `[K, D]` of the active rows back into zeros `[num_rows, D]`."""
    if active_rows is None:
        return values
    full = torch.zeros((num_rows,) + values.shape[1:], dtype=values.dtype, device=values.device)
    return full.index_copy_(0, active_rows, values)


def _dense_pass(
    h, table, bias, chunk_size, *, loss, weight=None, need=(False, False, False), ids=None
):
    """One pass over the vocabulary tiles for the dense background of the negatives.

    Per tile, the logits `z` `[M, T]` are computed once (one matmul); the
    row's positives (`ids`, see `_TilePositives`) are set to `-inf` in the
    logits (one O(M L) `index_fill_`), where `softplus` and `sigmoid` are
    exactly 0, so the negatives alone are summed; then,
    if `loss`, `softplus(z)` is summed per row, and, if `weight` is given,
    `S = weight[:, None] * sigmoid(z)` (the derivative of
    `sum_m weight_m sum_v softplus(z_mv)`) goes into the needed gradients:
    `S @ E_tile` for `h`, `(h.T @ S).T` for the table tile, `S.sum(0)` (as
    `S.T @ 1`) for the bias tile. The row weights are folded into the
    products (`h` is pre-scaled for the table, `grad_h` is scaled once at
    the end), so no `[M, T]` pass is spent on them. Only `[M, T]` buffers
    are allocated (one or two, reused for every tile).

    Measured per `[4096, 1024]` tile (one CPU thread, D = 64): matmuls
    ~8-10 ms each, `softplus` ~14-16 ms, `sigmoid` ~4-5 ms. Sharing one
    `exp(-|z|)` between softplus and sigmoid with separate torch ops costs
    more passes over `[M, T]` than the second `exp` inside `sigmoid`, so the
    two stock kernels are used; a single fused elementwise kernel
    (`torch.compile`) would save ~7 ms per tile but compiles for ~60 s.

    Args:
        h: `[M, D]` in the compute dtype.
        table: `[V, D]`; tiles are cast to `h.dtype`.
        bias: optional `[V]`.
        chunk_size: tile width.
        loss: whether to return the per-row `sum_v softplus(z_v)`.
        weight: optional `[M]` row weights of the dense gradient.
        need: which gradients to compute, for `(h, table, bias)`.
        ids: optional integer `[M, L]` targets whose logits are skipped.

    Returns:
        `(softplus_sum, grad_h, grad_table, grad_bias)`, each `None` when
        not asked for; gradients in the compute dtype.

    Example:

    >>> h, table = torch.randn(3, 4), torch.randn(10, 4)
    >>> sp, gh, ge, gb = _dense_pass(h, table, None, 4, loss=True,
    ...                              weight=torch.ones(3), need=(True, True, False))
    >>> torch.allclose(sp, F.softplus(h @ table.T).sum(1)), gb is None
    (True, True)
    """
    dtype, device = h.dtype, h.device
    num_rows, dim = h.shape
    vocab_size = table.shape[0]
    need_h, need_e, need_b = need if weight is not None else (False, False, False)
    grads = need_h or need_e or need_b
    width = max(1, min(chunk_size, vocab_size))
    positives = _TilePositives(ids, vocab_size, width)
    logits_buffer = torch.empty(num_rows * width, dtype=dtype, device=device)
    softplus_sum = None
    if loss:
        threshold = _softplus_threshold(dtype)
        ones = torch.ones(width, dtype=dtype, device=device)
        softplus_sum = torch.zeros(num_rows, dtype=dtype, device=device)
        # With gradients the logits are still needed after softplus.
        softplus_buffer = (
            torch.empty(num_rows * width, dtype=dtype, device=device) if grads else logits_buffer
        )
    grad_h = torch.zeros(num_rows, dim, dtype=dtype, device=device) if need_h else None
    grad_b = torch.empty(vocab_size, dtype=dtype, device=device) if need_b else None
    if need_e:
        # The table gradient is built transposed, `[D, V]`: `h.T @ S` per tile
        # is a faster product than `S.T @ h` (a wide output).
        weighted_h_t = (weight[:, None] * h).T
        grad_e_t = torch.empty(dim, vocab_size, dtype=dtype, device=device)
        grad_e_tile = torch.empty(dim * width, dtype=dtype, device=device)

    for start in range(0, vocab_size, width):
        stop = min(start + width, vocab_size)
        size = num_rows * (stop - start)
        table_tile = table[start:stop].to(dtype)
        z = logits_buffer[:size].view(num_rows, stop - start)
        _tile_logits_into(z, h, table_tile, None if bias is None else bias[start:stop])
        skip = positives.flat(start, stop)
        if skip is not None:
            # The positives' logits become -inf: softplus and sigmoid are then
            # exactly 0 there, so the negatives alone are summed.
            logits_buffer[:size].index_fill_(0, skip, float("-inf"))
        if loss:
            sp = softplus_buffer[:size].view(num_rows, stop - start)
            torch.ops.aten.softplus.out(z, 1.0, threshold, out=sp)
            softplus_sum.addmv_(sp, ones[: stop - start])
        if grads:
            s = z.sigmoid_()
            if need_h:
                grad_h.addmm_(s, table_tile)
            if need_e:
                tile = grad_e_tile[: dim * (stop - start)].view(dim, stop - start)
                grad_e_t[:, start:stop] = torch.mm(weighted_h_t, s, out=tile)
            if need_b:
                torch.mv(s.T, weight, out=grad_b[start:stop])
    if need_h:
        grad_h *= weight[:, None]
    # A transposed view of the `[D, V]` buffer: no second `[V, D]` copy (the
    # optimizer's update, or autograd accumulating into `.grad`, reads it as is).
    grad_e = grad_e_t.T if need_e else None
    return softplus_sum, grad_h, grad_e, grad_b


def _sparse_terms(h, table, bias, ids, coef, *, loss, weight=None, grads=(None, None, None)):
    """The linear background and the positives' correction, in closed form.

    The per-row loss is `(neg_scale * sum_v softplus(z_v) + terms) / V`;
    this returns `terms` (`-neg_target * sum_v z_v` plus the positives'
    `pos_minus softplus(-z_p) + pos_plus softplus(z_p) + neg_target z_p`) if `loss`, and, if
    `weight` is given, adds the gradient of `sum_m weight_m * terms_m` into
    the `grads` buffers `(grad_h, grad_table, grad_bias)` (any may be None).

    Example:

    >>> coef = bce_coefficients(0.0, 1.0)
    >>> h, table = torch.randn(2, 3), torch.randn(5, 3)
    >>> terms = _sparse_terms(h, table, None, torch.tensor([[1], [-1]]), coef, loss=True)
    >>> torch.allclose(terms, torch.stack([F.softplus(-(h[0] @ table[1])), torch.tensor(0.0)]))
    True
    """
    dtype = h.dtype
    num_rows, dim = h.shape
    vocab_size = table.shape[0]
    grad_h, grad_e, grad_b = grads if weight is not None else (None, None, None)
    terms = torch.zeros(num_rows, dtype=dtype, device=h.device) if loss else None

    # Linear background: d/dz of -neg_target * z is the constant -neg_target.
    if coef.neg_target != 0.0 and (loss or any(g is not None for g in (grad_h, grad_e, grad_b))):
        table_sum = table.sum(0, dtype=dtype)
        if loss:
            logit_sum = torch.mv(h, table_sum)
            if bias is not None:
                logit_sum += bias.sum(dtype=dtype)
            terms -= coef.neg_target * logit_sum
        if weight is not None:
            const = weight * coef.neg_target
            if grad_h is not None:
                grad_h.addr_(const, table_sum, alpha=-1.0)
            if grad_e is not None:
                grad_e -= (const @ h)[None, :]
            if grad_b is not None:
                grad_b -= const.sum()

    # Positives (skipped by the dense pass): their exact terms, plus
    # `neg_target * z` to take them out of the linear background above.
    if ids.shape[1] > 0:
        safe, keep = _positives(ids, vocab_size)
        rows, zp = _positive_logits(h, table, bias, safe, dtype)
        if loss:
            pos_terms = _positive_terms(zp, coef)
            if coef.neg_target != 0.0:
                pos_terms = pos_terms + coef.neg_target * zp
            terms += (pos_terms * keep).sum(1)
        if weight is not None and any(g is not None for g in (grad_h, grad_e, grad_b)):
            dz = _positive_slopes(zp, coef)
            if coef.neg_target != 0.0:
                dz = dz + coef.neg_target
            dz = dz * keep * weight[:, None]
            flat = safe.reshape(-1)
            if grad_h is not None:
                grad_h += torch.bmm(dz.unsqueeze(1), rows).squeeze(1)
            if grad_e is not None:
                grad_e.index_add_(0, flat, (dz.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, dim))
            if grad_b is not None:
                grad_b.index_add_(0, flat, dz.reshape(-1))
    return terms


def _row_losses(h, table, bias, ids, coef, chunk_size, weight=None, need=(False, False, False)):
    """Per-row losses `[M]` and, with `weight` (the cotangent), their gradients.

    Everything in one pass over the vocabulary: the gradients are those of
    `sum_m weight_m * loss_m`.
    """
    vocab_size = table.shape[0]
    g = None if weight is None else weight / vocab_size
    softplus_sum, grad_h, grad_e, grad_b = _dense_pass(
        h, table, bias, chunk_size, loss=True,
        weight=None if g is None else g * coef.neg_scale, need=need, ids=ids,
    )
    terms = _sparse_terms(h, table, bias, ids, coef, loss=True, weight=g, grads=(grad_h, grad_e, grad_b))
    loss = (coef.neg_scale * softplus_sum + terms) / vocab_size
    return loss, grad_h, grad_e, grad_b


def _row_gradients(h, table, bias, ids, coef, chunk_size, weight, need):
    """Gradients of `sum_m weight_m * loss_m` (no loss): the backward of `cut_bce`."""
    g = weight / table.shape[0]
    _, grad_h, grad_e, grad_b = _dense_pass(
        h, table, bias, chunk_size, loss=False, weight=g * coef.neg_scale, need=need, ids=ids
    )
    _sparse_terms(h, table, bias, ids, coef, loss=False, weight=g, grads=(grad_h, grad_e, grad_b))
    return grad_h, _contiguous(grad_e), grad_b


def _contiguous(grad):
    return None if grad is None else grad.contiguous()


def _cast(grad, like):
    return None if grad is None else grad.to(like.dtype)


class _CutBCEFunction(torch.autograd.Function):
    """Per-row CutBCE loss with exact, tile-by-tile gradients for any cotangent."""

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, coef, chunk_size):
        dtype = _compute_dtype(hidden, table, bias)
        loss, _, _, _ = _row_losses(hidden.to(dtype), table, bias, ids, coef, chunk_size)
        ctx.save_for_backward(hidden, table, bias, ids)
        ctx.coef = coef
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, table, bias, ids = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        if not any(need):
            return None, None, None, None, None, None
        dtype = _compute_dtype(hidden, table, bias)
        # Rows with a zero cotangent (masked or padded positions) add nothing:
        # drop them before the tile loop, scatter grad_hidden back at the end.
        active_rows, g, h, ids = _drop_zero_rows(grad_loss.to(dtype), hidden.to(dtype), ids)
        grad_h, grad_e, grad_b = _row_gradients(h, table, bias, ids, ctx.coef, ctx.chunk_size, g, need)
        if grad_h is not None:
            grad_h = _scatter_rows(grad_h, active_rows, hidden.shape[0])
        return _cast(grad_h, hidden), _cast(grad_e, table), _cast(grad_b, bias), None, None, None


class _CutBCEWeightedSumFunction(torch.autograd.Function):
    """`sum_m w_m * loss_m` whose gradients are computed in the forward pass.

    The row weights are constants, so the gradient for an upstream scalar
    cotangent `c` is `c` times the gradient at `c = 1`: the forward pass
    computes it along with the loss (one logits matmul per tile instead of
    two) and the backward pass only scales it.
    """

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, row_weights, coef, chunk_size, need):
        dtype = _compute_dtype(hidden, table, bias)
        active_rows, w, h, ids = _drop_zero_rows(row_weights.to(dtype), hidden.to(dtype), ids)
        loss, grad_h, grad_e, grad_b = _row_losses(h, table, bias, ids, coef, chunk_size, w, need)
        if grad_h is not None:
            grad_h = _scatter_rows(grad_h, active_rows, hidden.shape[0])
        ctx.save_for_backward(grad_h, grad_e, grad_b)
        ctx.dtypes = (hidden.dtype, table.dtype, None if bias is None else bias.dtype)
        return torch.dot(w, loss)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        # The usual cotangent is exactly 1 (a loss's own backward): then the
        # saved gradients are returned as they are, without a second
        # `[V, D]` buffer for the product.
        unit = not _capturing(grad_total) and bool(grad_total == 1)
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if grad is not None and not unit:
                grad = grad * grad_total.to(grad.dtype)
            grads.append(None if grad is None else grad.to(dtype))
        return tuple(grads) + (None,) * 5


def _check_chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be a positive int; received {chunk_size!r}.")


def _as_ids(ids, device):
    ids = torch.as_tensor(ids, device=device)
    return ids[:, None] if ids.ndim == 1 else ids


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
    _check_chunk_size(chunk_size)
    coef = bce_coefficients(label_smoothing, pos_weight)
    ids = _as_ids(ids, hidden.device)
    return _CutBCEFunction.apply(hidden, table, bias, ids, coef, chunk_size)


def cut_bce_weighted_sum(
    hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight, chunk_size
):
    """`sum_m row_weights[m] * cut_bce(...)[m]`, with its gradients fused in.

    What a reduced loss needs (sample weights, masks and the reduction's
    divisor are the row weights, constants without gradient). When a
    gradient is needed, the one pass over the vocabulary tiles that computes
    the loss also computes the gradients of `hidden`, `table` and `bias`
    (only those that require grad): per tile, one logits matmul, one
    `softplus` and one `sigmoid` over the `[M, T]` logits, then one product
    per gradient. The backward pass only scales them by the upstream
    cotangent. Rows with a zero weight are skipped. Without gradients (under
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
        chunk_size: positive int, the width of a vocabulary tile.

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
    _check_chunk_size(chunk_size)
    coef = bce_coefficients(label_smoothing, pos_weight)
    ids = _as_ids(ids, hidden.device)
    row_weights = torch.as_tensor(row_weights, device=hidden.device).detach().reshape(-1)
    need = (
        hidden.requires_grad,
        table.requires_grad,
        bias is not None and bias.requires_grad,
    )
    if torch.is_grad_enabled() and any(need):
        return _CutBCEWeightedSumFunction.apply(
            hidden, table, bias, ids, row_weights, coef, chunk_size, need
        )
    with torch.no_grad():
        dtype = _compute_dtype(hidden, table, bias)
        _, w, h, ids = _drop_zero_rows(row_weights.to(dtype), hidden.to(dtype), ids)
        loss, _, _, _ = _row_losses(h, table, bias, ids, coef, chunk_size)
        return torch.dot(w, loss)
