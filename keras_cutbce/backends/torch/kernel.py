"""The torch CutBCE kernel: the loop over vocabulary tiles and the closed-form parts.

The loss of one row is `(1 / V) * sum_v [minus_v softplus(-z_v) + plus_v
softplus(z_v)]` with `z = h @ E.T + b` (`keras_cutbce.math.coefficients`).
A negative's term is also `neg_scale softplus(z) - neg_target z`, so the
work splits in three:

- the dense background `neg_scale * sum_v softplus(z_v)` over the negatives
  (`dense_pass`), tile by tile over the vocabulary (`keras_cutbce.math.
  tiling.vocab_tiles`): one matmul and one `softplus` per logit for the
  loss; one `sigmoid` and one matmul per needed gradient for the
  gradients (logits are recomputed per pass, never stored). The row's
  positives are set to `-inf` in each tile's logits (an O(M L)
  `index_fill_` of a mask, see `Positives`), where `softplus` and `sigmoid` are
  exactly 0: never added and subtracted back, so a saturated positive
  keeps full precision. `neg_scale` is folded into the reductions (the
  per-row sum and the row scales), not applied per logit;
- the linear background `neg_target * sum_v z_v = neg_target * (h . sum_v
  E_v + sum_v b_v)`, in closed form (non-zero only with label smoothing),
  with the positives' `z` taken back out (`sparse_terms`);
- the positives, a gather of the table rows at the valid, de-duplicated
  ids, with their exact terms (`sparse_terms`).

The loss is the one varying piece: the loop is given a loss family
(`math.BCE`; the seam: docs/development.md) for what a tile adds to the rows,
its slopes, the linear background's weight and the positives' terms; the
positives are found once per pass (`Positives`). What is torch's own: a
Python loop over the tiles, and preallocated `out=` buffers: only `[M, T]`
buffers exist per tile, and one of each is reused for every tile.
Everything runs in the compute dtype (`math.compute_dtype`).
"""

import torch

from keras_cutbce.backends.torch.positives import Positives
from keras_cutbce.math.tiling import vocab_tiles


def tile_logits(hidden, table_tile, bias_tile=None):
    """Returns the float32 logits `[M, T]` of one vocabulary tile.

    Example:

    >>> tile_logits(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)).shape
    torch.Size([2, 4])
    """
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


def dense_pass(h, table, bias, tiles, positives, *, loss, row_scale=None, need=(False,) * 3,
               family, stats=None):
    """Returns the background `sum_v softplus(z_v)` over each row's negatives, and its gradients.

    Per tile, the logits `z` `[M, T]` are computed once (one matmul); the
    row's positives are set to `-inf` (one O(M L) `index_fill_`), where
    `softplus` and `sigmoid` are exactly 0; then, if `loss`,
    `math.terms(z, 0, 1) = softplus(z)` is summed per row, and, with
    `row_scale`, `S = row_scale[:, None] * math.slopes(z, 0, 1)` (the
    derivative of `sum_m row_scale_m sum_v softplus(z_mv)`) goes into the
    needed gradients: `S @ E_tile` for `h`, `(h.T @ S).T` for the table
    tile, `S.T @ row_scale` for the bias tile. The row scales are folded
    into the products (`h` is pre-scaled for the table, the hidden gradient
    is scaled once at the end), so no `[M, T]` pass is spent on them.

    Args:
        h: `[M, D]` in the compute dtype.
        table: `[V, D]`; tiles are cast to `h.dtype`.
        bias: optional `[V]`.
        tiles: the `VocabTiles` of the pass.
        positives: the `Positives` of the pass, skipped in every tile.
        loss: whether to return the per-row sum.
        row_scale: optional `[M]` factors of the gradient's rows.
        need: which gradients to compute, for `(h, table, bias)`.
        family: the loss family (`math.BCE`): what a tile adds to the rows
            and its slopes; `stats`: a first pass's row statistics.

    Returns:
        `(softplus_sum, grad_h, grad_table, grad_bias)`, each None when
        not asked for; gradients in the compute dtype (the table's a
        transposed view of a `[D, V]` buffer).

    Example:

    >>> import torch.nn.functional as F
    >>> h, table, ids = torch.randn(3, 4), torch.randn(10, 4), torch.zeros(3, 0, dtype=torch.long)
    >>> tiles = vocab_tiles(10, 4)
    >>> from keras_cutbce.backends.torch.math import BCE
    >>> from keras_cutbce.math.coefficients import bce_coefficients
    >>> sp, gh, ge, gb = dense_pass(h, table, None, tiles, Positives(ids, tiles), loss=True,
    ...                             row_scale=torch.ones(3), need=(True, True, False),
    ...                             family=BCE(bce_coefficients()))
    >>> torch.allclose(sp, F.softplus(h @ table.T).sum(1)), gb is None
    (True, True)
    """
    dtype, device = h.dtype, h.device
    num_rows, dim = h.shape
    vocab_size, tile = tiles.vocab_size, tiles.tile
    need_h, need_e, need_b = need if row_scale is not None else (False, False, False)
    grads = need_h or need_e or need_b
    # One spare element past the largest tile: where `Positives.flat` points
    # the positives of the other tiles.
    logits_buffer = torch.empty(num_rows * tile + 1, dtype=dtype, device=device)
    softplus_sum = None
    if loss:
        ones = torch.ones(tile, dtype=dtype, device=device)
        softplus_sum = family.init(num_rows, dtype, device)
        # With gradients the logits are still needed after softplus.
        softplus_buffer = (
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
            family.tile(z, softplus_sum, stats, out=softplus_buffer[:size].view(num_rows, stop - start),
                        ones=ones[: stop - start])
        if grads:
            s = family.slopes(z, stats)
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
    return softplus_sum, grad_h, grad_e, grad_b


def sparse_terms(h, table, bias, positives, family, *, loss, row_scale=None, grads=(None,) * 3):
    """Returns the linear background and the positives' terms; adds their gradients.

    The per-row loss is `(neg_scale * sum_v softplus(z_v) + terms) / V`;
    this returns `terms` (`-neg_target * sum_v z_v` plus each positive's
    `math.terms(z_p, *coef.positive_weights) + neg_target z_p`) if `loss`,
    and, with `row_scale`, adds the gradient of `sum_m row_scale_m *
    terms_m` into the `grads` buffers `(grad_h, grad_table, grad_bias)`
    (any may be None).

    Example:

    >>> import torch.nn.functional as F
    >>> from keras_cutbce.backends.torch.math import BCE
    >>> from keras_cutbce.math.coefficients import bce_coefficients
    >>> h, table, ids = torch.randn(2, 3), torch.randn(5, 3), torch.tensor([[1], [-1]])
    >>> positives = Positives(ids, vocab_tiles(5, 5))
    >>> terms = sparse_terms(h, table, None, positives, BCE(bce_coefficients()), loss=True)
    >>> torch.allclose(terms, torch.stack([F.softplus(-(h[0] @ table[1])), torch.tensor(0.0)]))
    True
    """
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
        pos_terms, dz = family.positives(zp, keep, loss=loss, grad=any_grad)
        if loss:
            terms += (pos_terms * keep).sum(1)
        if any_grad:
            dz = dz * keep * row_scale[:, None]
            flat = safe.reshape(-1)
            if grad_h is not None:
                grad_h += torch.bmm(dz.unsqueeze(1), rows).squeeze(1)
            if grad_e is not None:
                grad_e.index_add_(0, flat, (dz.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, dim))
            if grad_b is not None:
                grad_b.index_add_(0, flat, dz.reshape(-1))
    return terms


def row_losses(h, table, bias, ids, family, tile, row_scale=None, need=(False,) * 3, *,
               dense=dense_pass):
    """Returns the per-row losses `[M]` and, with a cotangent `row_scale` `[M]`, their gradients.

    Everything in one pass over the vocabulary (two for a `two_pass`
    family): the gradients (in the compute dtype, or None) are those of
    `sum_m row_scale_m * loss_m`. `dense` computes the dense terms
    (`dense_pass`'s signature): the tile loop here, the fused Triton kernels
    on CUDA (`keras_cutbce.backends.torch.triton.launch`).
    """
    tiles = vocab_tiles(table.shape[0], tile)
    positives = Positives(ids, tiles)
    dense_scale, sparse_scale = (None, None) if row_scale is None else family.row_scales(
        row_scale, positives, tiles.vocab_size)
    stats = _statistics(h, table, bias, tiles, positives, family, dense, row_scale)
    dense_sum, grad_h, grad_e, grad_b = dense(
        h, table, bias, tiles, positives, loss=True, row_scale=dense_scale, need=need,
        family=family, stats=stats,
    )
    terms = sparse_terms(
        h, table, bias, positives, family, loss=True, row_scale=sparse_scale,
        grads=(grad_h, grad_e, grad_b),
    )
    loss = family.finish(dense_sum, terms, positives, tiles.vocab_size)
    return loss, grad_h, grad_e, grad_b


def row_gradients(h, table, bias, ids, family, tile, row_scale, need, *, dense=dense_pass):
    """Returns the gradients of `sum_m row_scale_m * loss_m` (no loss), the table's contiguous."""
    tiles = vocab_tiles(table.shape[0], tile)
    positives = Positives(ids, tiles)
    dense_scale, sparse_scale = family.row_scales(row_scale, positives, tiles.vocab_size)
    stats = _statistics(h, table, bias, tiles, positives, family, dense, row_scale)
    _, grad_h, grad_e, grad_b = dense(
        h, table, bias, tiles, positives, loss=False, row_scale=dense_scale, need=need,
        family=family, stats=stats,
    )
    sparse_terms(
        h, table, bias, positives, family, loss=False, row_scale=sparse_scale,
        grads=(grad_h, grad_e, grad_b),
    )
    return grad_h, None if grad_e is None else grad_e.contiguous(), grad_b


def _statistics(h, table, bias, tiles, positives, family, dense, row_scale):
    """A `two_pass` family's row statistics (a first pass over the tiles) when slopes are needed."""
    if not family.two_pass or row_scale is None:
        return None
    acc, _, _, _ = dense(h, table, bias, tiles, positives, loss=True, family=family)
    return family.statistics(acc)
