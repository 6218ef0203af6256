"""The chunked implementation on torch: a Python loop over vocabulary tiles in `autograd.Function`s.

A row's loss is the dense background over the tiles (`dense_pass`, one
`[M, T]` buffer each, reused), the linear background in closed form and
the positives' exact terms (`sparse_terms`). Nothing on the per-call path
reads a device value on the host (no CUDA sync, no graph break).
"""

import torch
from torch.autograd.function import once_differentiable

from keras_cutbce.backends.torch import math
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import vocab_tiles


class Positives:
    """A pass's valid, de-duplicated target ids (`safe` int64 `[M, L]`, `keep` bool); a tile's are a mask, never a host count."""

    def __init__(self, ids, tiles):
        self.empty = ids.shape[1] == 0
        if self.empty:
            return
        safe, keep = distinct_targets(ids, tiles.vocab_size)
        self.safe, self.keep = safe.long(), keep
        self.counted = keep  # the ids a family counts per row (a vocab shard's: all of V's)
        self._rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        self._tile_bounds = tiles.bounds()

    def flat(self, index):
        """Flat offsets of tile `index`'s positives in its `[M, width]` buffer; the others point one past it."""
        if self.empty:
            return None
        start, stop = self._tile_bounds[index]
        width = stop - start
        in_tile = self.keep & (self.safe >= start) & (self.safe < stop)
        offsets = self._rows * width + (self.safe - start)
        spare = torch.full((), self.safe.shape[0] * width, dtype=offsets.dtype, device=offsets.device)
        return torch.where(in_tile, offsets, spare).reshape(-1)
    def logits(self, hidden, table, bias, dtype):
        """The table rows at the positives `[M, L, D]` and their logits `[M, L]`."""
        rows = table[self.safe].to(dtype)
        z = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            z = z + bias[self.safe].to(dtype)
        return rows, z


def tile_logits(hidden, table_tile, bias_tile=None):
    """The float32 logits `[M, T]` of one vocabulary tile."""
    hidden = hidden.float()
    table_tile = table_tile.float()
    if bias_tile is None:
        return hidden @ table_tile.T
    return torch.addmm(bias_tile.float(), hidden, table_tile.T)


def _tile_logits_into(out, hidden, table_tile, bias_tile):
    table_tile = table_tile.to(out.dtype)
    if bias_tile is None:
        return torch.mm(hidden, table_tile.T, out=out)
    return torch.addmm(bias_tile.to(out.dtype), hidden, table_tile.T, out=out)


def dense_pass(h, table, bias, tiles, positives, *, loss, row_scale=None, need=(False,) * 3,
               family, stats=None):
    """The family's row reduction over the tiles and its gradients: `(acc, grad_h, grad_e, grad_b)`.

    Each None when not asked for; the table's a transposed view of `[D, V]`. A
    two-pass family's gradients without `stats`: a first pass gives them (and
    `acc`). The Triton kernels implement this signature.
    """
    need_h, need_e, need_b = need if row_scale is not None else (False, False, False)
    grads = need_h or need_e or need_b
    acc = None
    if family.two_pass and grads and stats is None:
        acc = tile_pass(h, table, bias, tiles, positives, loss=True, family=family)[0]
        stats = family.statistics(acc)
    out = tile_pass(h, table, bias, tiles, positives, loss=loss and acc is None, row_scale=row_scale,
                    need=need, family=family, stats=stats)
    return (out[0] if acc is None or not loss else acc,) + out[1:]


def tile_pass(h, table, bias, tiles, positives, *, loss, row_scale=None, need=(False,) * 3,
              family, stats=None):
    """One pass over the tiles (`dense_pass`, the statistics given)."""
    dtype, device = h.dtype, h.device
    num_rows, dim = h.shape
    vocab_size, tile = tiles.vocab_size, tiles.tile
    need_h, need_e, need_b = need if row_scale is not None else (False, False, False)
    grads = need_h or need_e or need_b
    # One spare element past the largest tile: where `Positives.flat` points
    # the positives of the other tiles.
    logits_buffer = torch.empty(num_rows * tile + 1, dtype=dtype, device=device)
    acc = None
    if loss:
        acc = family.init(num_rows, dtype=dtype, device=device)
        # With gradients the logits are still needed after the terms.
        terms_buffer = (
            torch.empty(num_rows * tile, dtype=dtype, device=device) if grads else logits_buffer
        )
    grad_h = torch.zeros(num_rows, dim, dtype=dtype, device=device) if need_h else None
    grad_b = torch.empty(vocab_size, dtype=dtype, device=device) if need_b else None
    if need_e:
        # The table gradient is built transposed, `[D, V]`: `h.T @ S` per tile
        # is a faster product than `S.T @ h` (a wide output).
        scaled_h_t = (row_scale[:, None] * h).T
        grad_e_t = torch.empty(dim, vocab_size, dtype=dtype, device=device)
        grad_e_tile = torch.empty(dim * tile, dtype=dtype, device=device)

    for index, (start, stop) in enumerate(tiles.bounds()):
        size = num_rows * (stop - start)
        table_tile = table[start:stop].to(dtype)
        z = logits_buffer[:size].view(num_rows, stop - start)
        _tile_logits_into(z, h, table_tile, None if bias is None else bias[start:stop])
        skip = positives.flat(index) if family.masks_positives else None
        if skip is not None:
            logits_buffer[: size + 1].index_fill_(0, skip, float("-inf"))
        if loss:
            family.tile(z, stats, loss=True, grad=False, acc=acc,
                        out=terms_buffer[:size].view(num_rows, stop - start))
        if grads:
            _, s = family.tile(z, stats, loss=False, grad=True, out=z)
            if need_h:
                grad_h.addmm_(s, table_tile)
            if need_e:
                tile_grad = grad_e_tile[: dim * (stop - start)].view(dim, stop - start)
                grad_e_t[:, start:stop] = torch.mm(scaled_h_t, s, out=tile_grad)
            if need_b:
                torch.mv(s.T, row_scale, out=grad_b[start:stop])
    if need_h:
        grad_h *= row_scale[:, None]
    # A transposed view of the `[D, V]` buffer: no second `[V, D]` copy (the
    # optimizer's update, or autograd accumulating into `.grad`, reads it as is).
    grad_e = grad_e_t.T if need_e else None
    return acc, grad_h, grad_e, grad_b


def sparse_terms(h, table, bias, positives, family, *, loss, row_scale=None, grads=(None,) * 3):
    """The linear background and the positives' terms `[M]` (if `loss`); adds their gradients into `grads`."""
    dtype = h.dtype
    num_rows, dim = h.shape
    grad_h, grad_e, grad_b = grads if row_scale is not None else (None, None, None)
    any_grad = any(g is not None for g in (grad_h, grad_e, grad_b))
    terms = torch.zeros(num_rows, dtype=dtype, device=h.device) if loss else None

    # Linear background: d/dz of -linear * z is the constant -linear.
    linear = family.linear
    if linear != 0.0 and (loss or any_grad):
        table_sum = table.sum(0, dtype=dtype)
        if loss:
            logit_sum = torch.mv(h, table_sum)
            if bias is not None:
                logit_sum += bias.sum(dtype=dtype)
            terms -= linear * logit_sum
        if row_scale is not None:
            const = row_scale * linear
            if grad_h is not None:
                grad_h.addr_(const, table_sum, alpha=-1.0)
            if grad_e is not None:
                grad_e -= (const @ h)[None, :]
            if grad_b is not None:
                grad_b -= const.sum()

    # Positives (skipped by the dense pass): their exact terms, plus
    # `neg_target * z` to take them out of the linear background above.
    if not positives.empty:
        keep, safe = positives.keep, positives.safe
        rows, zp = positives.logits(h, table, bias, dtype)
        pos_terms, dz = family.positives(zp, positives.counted, loss=loss, grad=any_grad)
        if loss:
            terms += torch.where(keep, pos_terms, 0.0).sum(1)  # a padding slot's logit may be -inf
        if any_grad:
            dz = dz * keep * row_scale[:, None]
            flat = safe.reshape(-1)
            if grad_h is not None:
                grad_h += torch.bmm(dz.unsqueeze(1), rows).squeeze(1)
            if grad_e is not None:
                add_rows(grad_e, flat, (dz.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, dim))
            if grad_b is not None:
                add_rows(grad_b, flat, dz.reshape(-1))
    return terms


def add_rows(out, index, values):
    """`out[index] += values` along dim 0, repeated indices summed in a fixed order (deterministic).

    `index_put_` with `accumulate`: on CUDA it sorts the indices and sums each
    one's values in turn (`index_add_` adds with atomics there, in any order).
    A transposed `out` (the loop's `[D, V]` buffer) is indexed along its last
    dim: the CUDA kernel would otherwise copy it to a contiguous one and back.
    """
    if out.ndim == 2 and not out.is_contiguous() and out.T.is_contiguous():
        torch.ops.aten.index_put_(out.T, [None, index], values.T, True)
    else:
        out.index_put_((index,), values, accumulate=True)


def row_losses(h, table, bias, ids, family, tile, row_scale=None, need=(False,) * 3, *,
               dense=dense_pass):
    """The per-row losses `[M]` and, with a cotangent `row_scale`, their gradients (`dense`: this loop's or Triton's)."""
    tiles = vocab_tiles(table.shape[0], tile)
    positives = Positives(ids, tiles)
    keep = None if positives.empty else positives.keep
    dense_scale, sparse_scale = (None, None) if row_scale is None else family.row_scale(
        row_scale, keep, tiles.vocab_size)
    acc, grad_h, grad_e, grad_b = dense(
        h, table, bias, tiles, positives, loss=True, row_scale=dense_scale, need=need, family=family,
    )
    positive_rows = sparse_terms(
        h, table, bias, positives, family, loss=True, row_scale=sparse_scale,
        grads=(grad_h, grad_e, grad_b),
    )
    loss = family.finish(acc, positive_rows, keep, tiles.vocab_size)
    return loss, grad_h, grad_e, grad_b


def row_gradients(h, table, bias, ids, family, tile, row_scale, need, *, dense=dense_pass):
    """The gradients of `sum_m row_scale_m * loss_m` (no loss), the table's contiguous."""
    tiles = vocab_tiles(table.shape[0], tile)
    positives = Positives(ids, tiles)
    keep = None if positives.empty else positives.keep
    dense_scale, sparse_scale = family.row_scale(row_scale, keep, tiles.vocab_size)
    _, grad_h, grad_e, grad_b = dense(
        h, table, bias, tiles, positives, loss=False, row_scale=dense_scale, need=need, family=family,
    )
    sparse_terms(
        h, table, bias, positives, family, loss=False, row_scale=sparse_scale,
        grads=(grad_h, grad_e, grad_b),
    )
    return grad_h, None if grad_e is None else grad_e.contiguous(), grad_b


def mask_zero_rows(weight, hidden):
    """`hidden` with the rows of zero weight zeroed: they add exactly 0, even where not finite."""
    return torch.where((weight != 0)[:, None], hidden, torch.zeros((), dtype=hidden.dtype))


def _cast(grad, like):
    return None if grad is None else grad.to(like.dtype)


class _CutBCEFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, family, tile, dense):
        dtype = compute_dtype(hidden, table, bias)
        loss, _, _, _ = row_losses(hidden.to(dtype), table, bias, ids, family, tile, dense=dense)
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
        grad_h, grad_e, grad_b = row_gradients(
            h, table, bias, ids, ctx.family, ctx.tile, row_scale, need, dense=ctx.dense
        )
        grads = _cast(grad_h, hidden), _cast(grad_e, table), _cast(grad_b, bias)
        return grads + (None,) * 4


class _CutBCEWeightedSumFunction(torch.autograd.Function):
    """`sum_m w_m * loss_m`, its gradients computed forward and scaled in place backward."""

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
    dtype = compute_dtype(hidden, table, bias)
    w = row_weights.to(dtype)
    h = mask_zero_rows(w, hidden.to(dtype))
    loss, grad_h, grad_e, grad_b = row_losses(
        h, table, bias, ids, family, tile, w, need, dense=dense
    )
    return torch.dot(w, loss), grad_h, grad_e, grad_b


def _tile(chunk_size):
    assert isinstance(chunk_size, int) and not isinstance(chunk_size, bool), chunk_size
    assert chunk_size > 0, chunk_size
    return chunk_size


def as_ids(ids, device):
    """Ids as a `[M, L]` tensor on `device` (one id a row: `[M, 1]`)."""
    ids = torch.as_tensor(ids, device=device)
    return ids[:, None] if ids.ndim == 1 else ids


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size):
    """The chunked `cut_bce` (the contract: `keras_cutbce.registry`)."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return per_row(family, hidden, table, ids, bias, _tile(chunk_size))


def per_row(family, hidden, table, ids, bias, tile, dense=dense_pass):
    """The per-row losses of `family` (differentiable), `dense` computing the tiles' part (`dense_pass`'s signature)."""
    ids = as_ids(ids, hidden.device)
    return _CutBCEFunction.apply(hidden, table, bias, ids, family, tile, dense)


def cut_bce_weighted_sum(
    hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight, chunk_size
):
    """The chunked `cut_bce_weighted_sum`; only the loss without gradients (`torch.no_grad`, no input requiring grad)."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    return weighted_sum(family, hidden, table, ids, bias, row_weights, _tile(chunk_size))


def weighted_sum(family, hidden, table, ids, bias, row_weights, tile, dense=dense_pass):
    """`sum(row_weights * per_row(...))`, the gradients computed with the loss (`per_row`'s arguments)."""
    ids = as_ids(ids, hidden.device)
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
        loss, _, _, _ = row_losses(h, table, bias, ids, family, tile, dense=dense)
        return torch.dot(w, loss)


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size):
    """The chunked `cut_softmax`: `cut_bce`'s loop with `math.Softmax`."""
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return per_row(family, hidden, table, ids, bias, _tile(chunk_size))


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing,
                             chunk_size):
    """The chunked `cut_softmax_weighted_sum`."""
    family = math.Softmax(float(label_smoothing), table.shape[0])
    return weighted_sum(family, hidden, table, ids, bias, row_weights, _tile(chunk_size))
