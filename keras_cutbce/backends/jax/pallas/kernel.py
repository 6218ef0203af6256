"""The Pallas TPU kernel of CutBCE: one pass over the table for a block of resident rows.

One kernel, three uses (`config.Pass`): the rows' loss sums, the gradients
under a row cotangent (`row_scale`), or both in one pass. Its grid is
`(core, vocabulary tile, row tile)`:

- the rows are resident: hidden states, ids `[L, rows]` and `row_scale`
  `[1, rows]` are fetched once per pass, and the loss `[1, rows]` and hidden
  gradient stay in VMEM for the whole pass, written back once. Per-row
  values travel lane-dense; the kernel moves them to and from the sublanes
  with one 128-aligned transpose per tile.
- the table tile and its gradient accumulator stay in VMEM across the inner
  row axis, so a pass reads the table once and writes its gradient once.
- on megacore chips the leading axis is "parallel": each TensorCore takes a
  contiguous half of the vocabulary tiles and writes its own loss and
  hidden-gradient partials (on one-core chips the axis has size 1).

What is Pallas-specific lives here: the layouts (the table read as its
`[D, V]` view when `D % 128 != 0`, a bitcast of XLA:TPU's layout, else as
`[V, D]`), the lane/sublane moves, the edge masks of the last, partial
vocabulary tile, and finding a row's positives inside a tile from its
sorted ids (`keras_cutbce.backends.jax.math.sorted_positives`) with a
prefetched bound on how many fall there. The per-logit terms and slopes are
`keras_cutbce.backends.jax.math`'s, the same functions the chunked kernel
calls.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import math
from keras_cutbce.backends.jax.pallas.tiling import LANES, cores_used, num_tiles
from keras_cutbce.common import EMPTY_ID, round_up

# `x @ y.T` ("NT"), `x @ y` ("NN") and `x.T @ y` ("TN") without materialising a transpose.
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _matmul(x, y, dims, cfg):
    """Returns `dot_general` in the matmul dtype, accumulated in float32."""
    dtype = jnp.dtype(cfg.mm_dtype)
    precision = cfg.precision if dtype == jnp.float32 else None
    return lax.dot_general(
        x.astype(dtype), y.astype(dtype), dims, precision=precision,
        preferred_element_type=jnp.float32,
    )


def _table_tile(table_ref, tile_index, cfg, edge):
    """Returns the table tile (`[D, tile]` or `[tile, D]`), items past V zeroed on the edge."""
    table = table_ref[...]
    if edge:
        items = lax.broadcasted_iota(jnp.int32, table.shape, 1 if cfg.dv_view else 0)
        inside = items + tile_index * cfg.tile < cfg.vocab_size
        table = jnp.where(inside, table, jnp.zeros_like(table))
    return table


def _logits(hidden, table, bias_ref, cfg):
    """Returns the float32 logits `[row_tile, tile]`: `hidden.T @ table` or `hidden @ table.T`."""
    z = _matmul(hidden, table, _TN if cfg.dv_view else _NT, cfg)
    if bias_ref is not None:
        z = z + bias_ref[...]
    return z


def _grad_hidden_tile(dz, table, cfg):
    """Returns a tile's hidden gradient in the rows' layout: `table @ dz.T` or `dz @ table`."""
    return _matmul(table, dz, _NT, cfg) if cfg.dv_view else _matmul(dz, table, _NN, cfg)


def _grad_table_tile(hidden, dz, cfg):
    """Returns a tile's table gradient in the table view's layout: `hidden @ dz` or `dz.T @ h`."""
    return _matmul(hidden, dz, _NN, cfg) if cfg.dv_view else _matmul(dz, hidden, _TN, cfg)


def _as_columns(rows, fill):
    """Returns `[k, n]` as `[n, k]` (one 128-aligned transpose: per-row values to the sublanes)."""
    k, n = rows.shape
    padded = round_up(k, LANES)
    if padded != k:
        rows = jnp.concatenate([rows, jnp.full((padded - k, n), fill, rows.dtype)], axis=0)
    return jnp.transpose(rows)[:, :k]


def _as_row(column):
    """Returns `[n, 1]` as `[1, n]` (per-row values back to the lanes)."""
    return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], LANES)))[0:1, :]


def _masks(ids, in_tile, shape, tile_index, cfg, edge):
    """Returns `(valid, positive)` bool `[row_tile, tile]` (valid is None when every column is).

    `valid`: columns below V, on the `edge` tile only (the last tile of an
    unaligned V). `positive`: the column is one of the row's positives.
    `ids` `[L, row_tile]` are each row's positives sorted ascending after
    `EMPTY_ID` padding, so the positives inside this tile are consecutive:
    row `m`'s start after its `first[m]` entries below the tile (counted in
    O(L row_tile)), and no row has more than `in_tile` of them (a scalar from
    the prefetched counts, usually 0 or 1). One compare per logit per such
    id, not one per id of the row.
    """
    lo = tile_index * cfg.tile
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + lo
    valid = cols < cfg.vocab_size if edge else None
    first = jnp.sum((ids < lo).astype(jnp.int32), axis=0, keepdims=True)  # [1, row_tile]
    slot = lax.broadcasted_iota(jnp.int32, ids.shape, 0)

    def add(k, hits):  # int32, not bool: Mosaic cannot carry a mask vector through a loop
        pick = jnp.max(jnp.where(slot == first + k, ids, EMPTY_ID), axis=0, keepdims=True)
        return jnp.where(cols == _as_columns(pick, EMPTY_ID), 1, hits)

    return valid, lax.fori_loop(0, in_tile, add, jnp.zeros(shape, jnp.int32)) != 0


def _masked(x, valid):
    return x if valid is None else jnp.where(valid, x, 0.0)


def kernel(*refs, cfg, ps):
    """Writes the loss sums and/or gradients of one block of resident rows.

    Grid `(core, j, i)`: TensorCore `core` ("parallel"), its vocabulary tile
    `j`, row tile `i` of the resident block. Refs, in order: the prefetched
    in-tile counts, hidden states (`[D, rows]` or `[rows, D]`), ids
    `[L, rows]`, `row_scale` `[1, rows]` (with gradients), the table tile,
    the bias tile (with a bias), the carried table and bias gradients (with
    `ps.carry`); outputs: loss `[1, rows]`, hidden gradient, table and bias
    gradients; scratch: the tile's float32 table and bias accumulators.
    """
    refs = list(refs)
    in_tile_ref, hidden_ref, ids_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    row_scale_ref = refs.pop(0) if ps.with_grads else None
    table_ref = refs.pop(0)
    bias_ref = refs.pop(0) if ps.has_bias else None
    carried_table = refs.pop(0) if ps.carry else None
    carried_bias = refs.pop(0) if ps.carry and ps.has_bias else None
    loss_ref = refs.pop(0) if ps.with_loss else None
    grad_hidden_ref = grad_table_ref = grad_bias_ref = acc_table = acc_bias = None
    if ps.with_grads:
        grad_hidden_ref, grad_table_ref = refs.pop(0), refs.pop(0)
        grad_bias_ref = refs.pop(0) if ps.has_bias else None
        acc_table = refs.pop(0)
        acc_bias = refs.pop(0) if ps.has_bias else None
    core, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile_index = core * ps.tiles_per_core + j
    row_tile = cfg.row_tile
    rows = pl.ds(pl.multiple_of(i * row_tile, row_tile), row_tile)

    def hidden_rows(ref):
        return ref.at[:, rows] if cfg.dv_view else ref.at[rows, :]

    def body(edge):
        @pl.when(j == 0)
        def _init_rows():  # this core's first visit of these rows
            if ps.with_loss:
                loss_ref[:, rows] = jnp.zeros((1, row_tile), jnp.float32)
            if ps.with_grads:
                grad_hidden = hidden_rows(grad_hidden_ref)
                grad_hidden[...] = jnp.zeros(grad_hidden.shape, jnp.float32)

        if ps.with_grads:
            @pl.when(i == 0)
            def _init_tile():  # first row tile of this vocabulary tile
                start = carried_table[...].astype(jnp.float32) if ps.carry else 0.0
                acc_table[...] = jnp.zeros_like(acc_table) + start
                if ps.has_bias:
                    start_bias = carried_bias[...] if ps.carry else 0.0
                    acc_bias[...] = jnp.zeros_like(acc_bias) + start_bias

        hidden = hidden_rows(hidden_ref)[...]
        table = _table_tile(table_ref, tile_index, cfg, edge)
        z = _logits(hidden, table, bias_ref, cfg)
        count_index = tile_index * pl.num_programs(2) + i if ps.counts_per_row_tile else tile_index
        valid, positive = _masks(ids_ref[:, rows], in_tile_ref[count_index], z.shape, tile_index,
                                 cfg, edge)
        e = math.exp_neg_abs(z)  # one exp per logit for the loss and the gradient
        if ps.with_loss:
            term = _masked(math.terms(z, e, cfg.coef, positive), valid)
            loss_ref[:, rows] += _as_row(jnp.sum(term, axis=1, keepdims=True))
        if ps.with_grads:
            # Padded rows have a zero row_scale, so they add nothing.
            row_scale = _as_columns(row_scale_ref[:, rows], 0.0)
            dz = _masked(row_scale * math.slopes(z, e, cfg.coef, positive), valid)
            grad_hidden = hidden_rows(grad_hidden_ref)
            grad_hidden[...] += _grad_hidden_tile(dz, table, cfg)
            acc_table[...] += _grad_table_tile(hidden, dz, cfg)
            if ps.has_bias:
                acc_bias[...] += jnp.sum(dz, axis=0, keepdims=True)

            @pl.when(i == pl.num_programs(2) - 1)
            def _store():
                grad_table_ref[...] = acc_table[...].astype(grad_table_ref.dtype)
                if ps.has_bias:
                    grad_bias_ref[...] = acc_bias[...]

    # The edge masks run on the last tile of an unaligned V only; the last
    # core's steps past the last tile (their blocks clamped) do nothing.
    tiles = num_tiles(cfg)
    if cfg.vocab_size % cfg.tile:
        pl.when(tile_index < tiles - 1)(lambda: body(False))
        pl.when(tile_index == tiles - 1)(lambda: body(True))
    elif ps.tiles_per_core * cores_used(cfg) == tiles:
        body(False)
    else:
        pl.when(tile_index < tiles)(lambda: body(False))
