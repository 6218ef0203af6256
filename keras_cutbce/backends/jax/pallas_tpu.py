"""CutBCE as Pallas TPU (Mosaic) kernels, under `jax.custom_vjp`.

The loss of a row is `(1 / V) * (negatives + positives)`:

- `negatives = sum_{v not in P} neg_scale * softplus(z_v) - neg_target * z_v`,
  computed by Pallas kernels over a grid of (row tiles, vocabulary tiles). A
  `[tm, tv]` logits tile exists only in VMEM; float32 accumulators live in
  VMEM. The row's positives `P` are masked inside each tile (its `[tm, L]`
  ids compared with the tile's columns, `L` vector compares per logit), so a
  positive is never added and subtracted back.
- `positives = sum_{v in P} pos_minus softplus(-z_v) + pos_plus softplus(z_v)`
  over the row's valid, de-duplicated positives
  (`keras_cutbce.backends.targets.distinct_targets`): a gather of `L` table
  rows per position, in plain JAX (small). Both parts are non-negative, so a
  saturated positive (|z| = 1e4, a row of loss 1e-43) keeps float32
  precision; its gradient is `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.

The coefficients come from `keras_cutbce.coefficients.bce_coefficients`.
One `exp` and one `log1p` per logit (`e = exp(-|z|)`, `softplus(z) =
max(z, 0) + log1p(e)`, `sigmoid(z) = 1 / (1 + e)` or `e / (1 + e)`), all in
float32, so the loss and its gradients stay finite for any `|z|`.

Kernels (all recompute the logits `z = h @ E.T + b`; matmuls run in the
matmul dtype with float32 accumulation: the hidden states' dtype when it is
16-bit (Keras mixed precision: bfloat16 activations, float32 table; the
table tile is cast in VMEM), else the promoted dtype; `Precision.HIGHEST`
only when that is float32):

1. forward, grid `(rows, vocab)`: the per-row sum over the negatives.
2. `grad_hidden`, grid `(rows, vocab)`: `sum_v dz[m, v] E_v`,
   `dz = g_m (neg_scale * sigmoid(z) - neg_target)` at the negatives.
3. `grad_table` and `grad_bias`, grid `(vocab, rows)` (transposed):
   `sum_m dz[m, v] h_m` and `sum_m dz[m, v]` accumulated over row tiles.
4. fused (the training path of a reduced loss, `cut_bce_weighted_sum`),
   grid `(vocab, rows)`: the loss and the three gradients for constant row
   weights in ONE pass over the logits. The table and bias gradient blocks
   accumulate over the inner row axis; the loss and hidden gradient of every
   row stay resident in VMEM for the whole grid (`[M, 128 + D]` float32).
   When they do not fit in a quarter of the VMEM budget, the fused path runs
   kernels 1-3 instead (three logits passes).

The table is never padded or copied: the grid covers `cdiv(V, tv)` tiles and
the last, partial tile is masked in the kernels (its out-of-range rows are
zeroed before any product, its columns masked out of every sum). Only the
rows (hidden states, ids, cotangent: `O(M (D + L))`) are padded to the row
tile; padded rows have zero weight.

Layout: per-row vectors (the forward output, the cotangent) travel
lane-broadcast as `[rows, 128]` float32 arrays, the bias as a `[1, V]`
float32 row; blocks are `(tm, D)`, `(tv, D)`, `(1, tv)`, `(tm, L)` and
`(tm, 128)`.

Tile rule (`chunk_size=None`, `block_rows=None`):

- VMEM budget: half the chip's VMEM (`pltpu.get_tpu_info().vmem_capacity_bytes`
  when this JAX has it and the device is a TPU), and then the kernels ask
  Mosaic for `vmem_limit_bytes = 3/4 x capacity`; else 12 MiB, three quarters
  of 16 MiB, the smallest default scoped VMEM of current TPUs, leaving
  headroom for Mosaic's own temporaries.
- Row tile `tm`: `min(512, M rounded up to 128)`; vocabulary tile `tv`: the
  widest multiple of 128, at most 4096 and at most `V` rounded up to 128,
  whose estimated footprint fits the budget. The estimate counts
  double-buffered input tiles in the input dtype (`2 (tm + tv) D itemsize`),
  float32 accumulators and output buffers (`3 (tm + tv) D * 4`) and five
  float32 `[tm, tv]` intermediates (logits, exponential, term, transposed
  gradient, temporary). If no `tv` fits, `tm` halves (down to 128).
- Both tiles are multiples of 128: MXU- and lane-aligned, a multiple of the
  8/16 sublanes of float32/bfloat16, and the row tile is the lane axis of the
  transposed gradient tile `dz.T` in kernel 3. `chunk_size` overrides `tv` and
  `block_rows` overrides `tm` (both rounded up to 128).

Off TPU, and whenever `interpret=True`, the kernels run in the Pallas TPU
interpreter (`pltpu.InterpretParams()`, or `interpret=True` on JAX versions
without it): slow but exact, for tests on CPU.

Portability (JAX 0.10.2 and 0.11+): `pltpu.CompilerParams` was once
`pltpu.TPUCompilerParams`, `pltpu.InterpretParams` and `pltpu.get_tpu_info`
are recent; each is looked up with `getattr` and has a fallback. Grid
semantics are given as the strings `"parallel"` / `"arbitrary"`, accepted by
every version.

Example:

>>> import numpy as np
>>> h = np.random.normal(size=(4, 8)).astype("float32")
>>> table = np.random.normal(size=(300, 8)).astype("float32")
>>> ids = np.array([[1, 2], [3, -1], [5, 5], [0, 299]])
>>> cut_bce(h, table, ids, None, label_smoothing=0.0, pos_weight=1.0).shape
(4,)
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from keras_cutbce.backends.targets import distinct_targets
from keras_cutbce.coefficients import BCECoefficients, bce_coefficients
from keras_cutbce.common import ids_as_int32
from keras_cutbce.common import on_tpu as _on_tpu
from keras_cutbce.common import round_up as _round_up

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_VOCAB_TILE = 4096
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20
DEFAULT_VMEM_BUDGET_BYTES = DEFAULT_SCOPED_VMEM_BYTES * 3 // 4

# `x @ y.T` without materialising the transpose ("NT" matmul).
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


@functools.lru_cache(maxsize=None)
def vmem_capacity_bytes():
    """VMEM bytes of one TPU core, or None off TPU / when this JAX cannot tell."""
    if not _on_tpu():
        return None
    get_info = getattr(pltpu, "get_tpu_info", None)  # JAX >= 0.8 or so.
    if get_info is None:
        return None
    try:
        return int(get_info().vmem_capacity_bytes)
    except Exception:  # noqa: BLE001 - unknown chip, older runtime: use the default.
        return None


def _footprint_bytes(tm, tv, d, itemsize):
    inputs = 2 * (tm + tv) * d * itemsize + 2 * (tm * LANES + tv) * 4
    accumulators = 3 * (tm + tv) * d * 4 + 3 * tm * LANES * 4
    intermediates = 5 * tm * tv * 4
    return inputs + accumulators + intermediates


def choose_tiles(num_rows, vocab_size, dim, dtype, budget_bytes=None):
    """Returns `(row_tile, vocab_tile)` for the kernels (the module's tile rule).

    Example:

    >>> choose_tiles(130, 1000, 64, "float32", budget_bytes=16 * 2**20)
    (256, 1024)
    """
    if budget_bytes is None:
        capacity = vmem_capacity_bytes()
        budget_bytes = DEFAULT_VMEM_BUDGET_BYTES if capacity is None else capacity // 2
    itemsize = jnp.dtype(dtype).itemsize
    tm = min(MAX_ROW_TILE, _round_up(max(num_rows, 1), LANES))
    tv_max = min(MAX_VOCAB_TILE, _round_up(max(vocab_size, 1), LANES))
    while True:
        for tv in range(tv_max, 0, -LANES):
            if _footprint_bytes(tm, tv, dim, itemsize) <= budget_bytes:
                return tm, tv
        if tm <= MIN_ROW_TILE:
            return tm, LANES
        tm = max(MIN_ROW_TILE, tm // 2)


def _interpret_arg(interpret):
    """The `interpret=` value for `pl.pallas_call`."""
    if interpret is None:
        interpret = not _on_tpu()
    if not interpret:
        return False
    params = getattr(pltpu, "InterpretParams", None)  # JAX >= 0.6; else the generic interpreter.
    return params() if params is not None else True


def _compiler_params(semantics, interpret):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    kwargs = dict(dimension_semantics=semantics)
    capacity = None if interpret else vmem_capacity_bytes()
    if capacity is not None:
        kwargs["vmem_limit_bytes"] = int(capacity * 3 // 4)
    return cls(**kwargs)



class _Config(NamedTuple):
    """Static (hashable) settings of one call."""

    vocab_size: int
    coef: BCECoefficients
    row_tile: int
    vocab_tile: int
    num_ids: int
    mm_dtype: str
    interpret: bool


# ----------------------------------------------------------------------------
# In-kernel math: the one fused tile function and the per-logit terms.
# ----------------------------------------------------------------------------


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _matmul(x, y, dims, cfg):
    """`dot_general` in the matmul dtype, float32 accumulation."""
    dtype = jnp.dtype(cfg.mm_dtype)
    return lax.dot_general(
        x.astype(dtype), y.astype(dtype), dims, precision=_precision(dtype),
        preferred_element_type=jnp.float32,
    )


def _table_tile(t_ref, j, cfg):
    """The table tile; rows past V (the last, partial tile) are zeroed."""
    t = t_ref[...]
    if cfg.vocab_size % cfg.vocab_tile:
        rows = lax.broadcasted_iota(jnp.int32, t.shape, 0) + j * cfg.vocab_tile
        t = jnp.where(rows < cfg.vocab_size, t, jnp.zeros_like(t))
    return t


def _negatives(ids_ref, shape, j, cfg):
    """Bool `[tm, tv]`: the tile's logits that count as negatives.

    Columns past V and the row's positives (its ids, compared one id column
    at a time) are excluded.
    """
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + j * cfg.vocab_tile
    keep = cols < cfg.vocab_size
    for k in range(cfg.num_ids):
        keep = jnp.logical_and(keep, cols != ids_ref[:, k : k + 1])
    return keep


def _tile_logits(h, t, b_ref, cfg):
    """Float32 logits `[tm, tv]` of a row tile `h` against a vocabulary tile `t`."""
    z = _matmul(h, t, _NT, cfg)
    if b_ref is not None:
        z = z + b_ref[...]
    return z


def _negative_terms(z, coef):
    """`neg_scale * softplus(z) - neg_target * z` with one exp and one log1p."""
    softplus = jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))
    term = softplus if coef.neg_scale == 1.0 else coef.neg_scale * softplus
    return term if coef.neg_target == 0.0 else term - coef.neg_target * z


def _negative_slopes(z, coef):
    """`neg_scale * sigmoid(z) - neg_target` with one exp."""
    e = jnp.exp(-jnp.abs(z))
    inv = 1.0 / (1.0 + e)
    sigmoid = jnp.where(z >= 0, inv, e * inv)
    grad = sigmoid if coef.neg_scale == 1.0 else coef.neg_scale * sigmoid
    return grad if coef.neg_target == 0.0 else grad - coef.neg_target


def _unpack(refs, has_bias, has_weights):
    """Splits kernel refs into `(h, t, ids, bias | None, g | None, outputs_and_scratch)`."""
    refs = list(refs)
    h_ref, t_ref, ids_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    g_ref = refs.pop(0) if has_weights else None
    return h_ref, t_ref, ids_ref, b_ref, g_ref, refs


def _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg):
    """`(h, t, z, negatives)` of one (row tile, vocabulary tile)."""
    h, t = h_ref[...], _table_tile(t_ref, j, cfg)
    z = _tile_logits(h, t, b_ref, cfg)
    return h, t, z, _negatives(ids_ref, z.shape, j, cfg)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _forward_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, ids_ref, b_ref, _, (out_ref, acc_ref) = _unpack(refs, has_bias, False)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _, _, z, negative = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    term = jnp.where(negative, _negative_terms(z, cfg.coef), 0.0)
    acc_ref[...] += jnp.sum(term, axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        out_ref[...] = acc_ref[...]


def _grad_hidden_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, ids_ref, b_ref, g_ref, (out_ref, acc_ref) = _unpack(refs, has_bias, True)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _, t, z, negative = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    dz = jnp.where(negative, g_ref[:, :1] * _negative_slopes(z, cfg.coef), 0.0)
    acc_ref[...] += _matmul(dz, t, _NN, cfg)

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        out_ref[...] = acc_ref[...]


def _grad_table_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, ids_ref, b_ref, g_ref, outs = _unpack(refs, has_bias, True)
    if has_bias:
        dt_ref, db_ref, acc_t_ref, acc_b_ref = outs
    else:
        (dt_ref, acc_t_ref), db_ref, acc_b_ref = outs, None, None
    j, i = pl.program_id(0), pl.program_id(1)  # i: the reduction axis of this transposed grid.

    @pl.when(i == 0)
    def _init():
        acc_t_ref[...] = jnp.zeros_like(acc_t_ref)
        if has_bias:
            acc_b_ref[...] = jnp.zeros_like(acc_b_ref)

    h, _, z, negative = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    # Padded rows carry a zero cotangent, so they add nothing.
    dz = jnp.where(negative, g_ref[:, :1] * _negative_slopes(z, cfg.coef), 0.0)
    acc_t_ref[...] += _matmul(dz.T, h, _NN, cfg)
    if has_bias:
        acc_b_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dt_ref[...] = acc_t_ref[...]
        if has_bias:
            db_ref[...] = acc_b_ref[...]


def _fused_kernel(*refs, cfg, has_bias):
    """Loss and all gradients in one pass; grid (vocab tile j, row tile i)."""
    h_ref, t_ref, ids_ref, b_ref, g_ref, outs = _unpack(refs, has_bias, True)
    if has_bias:
        loss_ref, dh_ref, dt_ref, db_ref, acc_t_ref, acc_b_ref = outs
    else:
        (loss_ref, dh_ref, dt_ref, acc_t_ref), db_ref, acc_b_ref = outs, None, None
    j, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(i * cfg.row_tile, cfg.row_tile), cfg.row_tile)

    @pl.when(j == 0)
    def _init_rows():  # resident [M, .] outputs: first visit of these rows
        loss_ref[rows, :] = jnp.zeros((cfg.row_tile, LANES), jnp.float32)
        dh_ref[rows, :] = jnp.zeros((cfg.row_tile, dh_ref.shape[1]), jnp.float32)

    @pl.when(i == 0)
    def _init_tile():
        acc_t_ref[...] = jnp.zeros_like(acc_t_ref)
        if has_bias:
            acc_b_ref[...] = jnp.zeros_like(acc_b_ref)

    h, t, z, negative = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    term = jnp.where(negative, _negative_terms(z, cfg.coef), 0.0)
    loss_ref[rows, :] += jnp.sum(term, axis=1, keepdims=True) + jnp.zeros((1, LANES), jnp.float32)
    dz = jnp.where(negative, g_ref[:, :1] * _negative_slopes(z, cfg.coef), 0.0)
    dh_ref[rows, :] += _matmul(dz, t, _NN, cfg)
    acc_t_ref[...] += _matmul(dz.T, h, _NN, cfg)
    if has_bias:
        acc_b_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dt_ref[...] = acc_t_ref[...]
        if has_bias:
            db_ref[...] = acc_b_ref[...]


# ----------------------------------------------------------------------------
# pallas_call wrappers: rows padded to the row tile, the table never padded.
# ----------------------------------------------------------------------------


def _pad_rows(x, rows, value=0):
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=value)


def _row_inputs(h, ids, g, cfg):
    """Hidden states, ids and (lane-broadcast) row weights padded to the row tile."""
    mp = _round_up(h.shape[0], cfg.row_tile)
    hp, idsp = _pad_rows(h, mp), _pad_rows(ids, mp, -1)
    gp = None
    if g is not None:
        gp = jnp.broadcast_to(_pad_rows(g.astype(jnp.float32), mp)[:, None], (mp, LANES))
    return hp, idsp, gp


def _bias_row(b):
    return None if b is None else b.astype(jnp.float32).reshape(1, -1)


def _grid_sizes(mp, cfg):
    return mp // cfg.row_tile, pl.cdiv(cfg.vocab_size, cfg.vocab_tile)


def _specs(cfg, d, has_bias, has_weights, transposed):
    """BlockSpecs of (h, t, ids[, b][, g]) for grid (i, j), or (j, i) when `transposed`."""
    tm, tv, length = cfg.row_tile, cfg.vocab_tile, cfg.num_ids

    def at(fn):
        return (lambda j, i: fn(i, j)) if transposed else fn

    specs = [
        pl.BlockSpec((tm, d), at(lambda i, j: (i, 0))),
        pl.BlockSpec((tv, d), at(lambda i, j: (j, 0))),
        pl.BlockSpec((tm, length), at(lambda i, j: (i, 0))),
    ]
    if has_bias:
        specs.append(pl.BlockSpec((1, tv), at(lambda i, j: (0, j))))
    if has_weights:
        specs.append(pl.BlockSpec((tm, LANES), at(lambda i, j: (i, 0))))
    return specs


def _call(kernel, name, grid, in_specs, out_specs, out_shape, scratch, semantics, cfg, has_bias):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg, has_bias=has_bias),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=_compiler_params(semantics, cfg.interpret),
        interpret=_interpret_arg(cfg.interpret),
        name=name,
    )


def _table_grad_outputs(cfg, d, has_bias, index):
    """Out specs/shapes/scratch of the table (and bias) gradient, blocks at vocab tile `index`."""
    tv, vocab = cfg.vocab_tile, cfg.vocab_size
    specs = [pl.BlockSpec((tv, d), lambda j, i: (index(j, i), 0))]
    shapes = [jax.ShapeDtypeStruct((vocab, d), jnp.float32)]
    scratch = [pltpu.VMEM((tv, d), jnp.float32)]
    if has_bias:
        specs.append(pl.BlockSpec((1, tv), lambda j, i: (0, index(j, i))))
        shapes.append(jax.ShapeDtypeStruct((1, vocab), jnp.float32))
        scratch.append(pltpu.VMEM((1, tv), jnp.float32))
    return specs, shapes, scratch


def _dense_forward(h, t, b, ids, cfg):
    """Per-row sums over the negatives `[M]` float32 (kernel 1)."""
    hp, idsp, _ = _row_inputs(h, ids, None, cfg)
    mp, d = hp.shape
    has_bias = b is not None
    out = _call(
        _forward_kernel, "cutbce_forward", _grid_sizes(mp, cfg),
        _specs(cfg, d, has_bias, False, False),
        pl.BlockSpec((cfg.row_tile, LANES), lambda i, j: (i, 0)),
        jax.ShapeDtypeStruct((mp, LANES), jnp.float32),
        [pltpu.VMEM((cfg.row_tile, LANES), jnp.float32)],
        ("parallel", "arbitrary"), cfg, has_bias,
    )(*([hp, t, idsp] + ([_bias_row(b)] if has_bias else [])))
    return out[: h.shape[0], 0]


def _dense_backward(h, t, b, ids, g, cfg):
    """Float32 `(grad_hidden [M, D], grad_table [V, D], grad_bias [V] | None)` (kernels 2, 3)."""
    hp, idsp, gp = _row_inputs(h, ids, g, cfg)
    mp, d = hp.shape
    has_bias = b is not None
    inputs = [hp, t, idsp] + ([_bias_row(b)] if has_bias else []) + [gp]
    rows, tiles = _grid_sizes(mp, cfg)
    grad_h = _call(
        _grad_hidden_kernel, "cutbce_grad_hidden", (rows, tiles),
        _specs(cfg, d, has_bias, True, False),
        pl.BlockSpec((cfg.row_tile, d), lambda i, j: (i, 0)),
        jax.ShapeDtypeStruct((mp, d), jnp.float32),
        [pltpu.VMEM((cfg.row_tile, d), jnp.float32)],
        ("parallel", "arbitrary"), cfg, has_bias,
    )(*inputs)
    # Transposed grid (vocab tile j, row tile i): the table gradient is
    # accumulated over row tiles while its block stays in VMEM.
    specs, shapes, scratch = _table_grad_outputs(cfg, d, has_bias, lambda j, i: j)
    outs = _call(
        _grad_table_kernel, "cutbce_grad_table", (tiles, rows),
        _specs(cfg, d, has_bias, True, True), specs, shapes, scratch,
        ("parallel", "arbitrary"), cfg, has_bias,
    )(*inputs)
    grad_b = outs[1][0] if has_bias else None
    return grad_h[: h.shape[0]], outs[0], grad_b


def _fused_fits(num_rows, dim, cfg):
    """Whether the fused kernel's resident `[M, 128 + D]` float32 rows fit its VMEM share."""
    capacity = vmem_capacity_bytes()
    budget = DEFAULT_VMEM_BUDGET_BYTES if capacity is None else capacity // 2
    mp = _round_up(num_rows, cfg.row_tile)
    return 2 * mp * (LANES + dim) * 4 <= budget // 4


def _dense_fused(h, t, b, ids, w, cfg):
    """Kernel 4: `(negatives [M], grad_hidden, grad_table, grad_bias | None)` in one pass."""
    hp, idsp, gp = _row_inputs(h, ids, w, cfg)
    mp, d = hp.shape
    has_bias = b is not None
    rows, tiles = _grid_sizes(mp, cfg)
    specs, shapes, scratch = _table_grad_outputs(cfg, d, has_bias, lambda j, i: j)
    resident = [
        pl.BlockSpec((mp, LANES), lambda j, i: (0, 0)),
        pl.BlockSpec((mp, d), lambda j, i: (0, 0)),
    ]
    resident_shapes = [
        jax.ShapeDtypeStruct((mp, LANES), jnp.float32),
        jax.ShapeDtypeStruct((mp, d), jnp.float32),
    ]
    outs = _call(
        _fused_kernel, "cutbce_fused", (tiles, rows),
        _specs(cfg, d, has_bias, True, True), resident + specs, resident_shapes + shapes,
        scratch, ("arbitrary", "arbitrary"), cfg, has_bias,
    )(*([hp, t, idsp] + ([_bias_row(b)] if has_bias else []) + [gp]))
    num_rows = h.shape[0]
    grad_b = outs[3][0] if has_bias else None
    return outs[0][:num_rows, 0], outs[1][:num_rows], outs[2], grad_b


# ----------------------------------------------------------------------------
# The positives (plain JAX): exact terms, no cancellation.
# ----------------------------------------------------------------------------


def _positive_logits(h, t, b, safe, cfg):
    """Float32 logits `[M, L]` of each row at its (safe) positive ids."""
    rows = t[safe]  # [M, L, D]
    dtype = jnp.dtype(cfg.mm_dtype)
    z = jnp.einsum("md,mld->ml", h.astype(dtype), rows.astype(dtype),
                   precision=_precision(dtype), preferred_element_type=jnp.float32)
    if b is not None:
        z = z + b.astype(jnp.float32)[safe]
    return z, rows


def _positive_terms(z, coef):
    """`pos_minus softplus(-z) + pos_plus softplus(z)`: two non-negative parts."""
    out = coef.pos_minus * jax.nn.softplus(-z)
    return out if coef.pos_plus == 0.0 else out + coef.pos_plus * jax.nn.softplus(z)


def _positive_slopes(z, coef):
    """`pos_plus - (pos_plus + pos_minus) sigmoid(-z)`: the terms' exact derivative."""
    return coef.pos_plus - (coef.pos_plus + coef.pos_minus) * jax.nn.sigmoid(-z)


def _positives_forward(h, t, b, safe, keep, cfg):
    z, _ = _positive_logits(h, t, b, safe, cfg)
    return jnp.sum(jnp.where(keep, _positive_terms(z, cfg.coef), 0.0), axis=1)


def _positives_backward(h, t, b, safe, keep, gv, cfg):
    """Float32 gradients of `sum_m gv_m * positives_m` for h, t, b."""
    z, rows = _positive_logits(h, t, b, safe, cfg)
    dz = jnp.where(keep, gv[:, None] * _positive_slopes(z, cfg.coef), 0.0)  # [M, L]
    grad_h = jnp.einsum("ml,mld->md", dz, rows.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    contrib = dz[:, :, None] * h.astype(jnp.float32)[:, None, :]  # [M, L, D]
    grad_t = jnp.zeros(t.shape, jnp.float32).at[safe.reshape(-1)].add(
        contrib.reshape(-1, t.shape[1])
    )
    grad_b = None
    if b is not None:
        grad_b = jnp.zeros(b.shape, jnp.float32).at[safe.reshape(-1)].add(dz.reshape(-1))
    return grad_h, grad_t, grad_b


def _add(x, y):
    return None if x is None else x + y


def _grads_out(h, t, b, ids, grads):
    """Each gradient in its input's dtype; float0 for integer ids."""
    dh, dt, db = grads
    grad_ids = None
    if jnp.issubdtype(ids.dtype, jnp.integer):  # Integer primals take float0 cotangents.
        grad_ids = np.zeros(ids.shape, dtype=jax.dtypes.float0)
    return dh.astype(h.dtype), dt.astype(t.dtype), None if b is None else db.astype(b.dtype), grad_ids


# ----------------------------------------------------------------------------
# custom_vjp: per-row loss (any cotangent) and fused weighted sum.
# ----------------------------------------------------------------------------


def _per_row_loss(cfg, h, t, b, ids):
    safe, keep = distinct_targets(ids, cfg.vocab_size)
    dense = _dense_forward(h, t, b, ids, cfg)
    return (dense + _positives_forward(h, t, b, safe, keep, cfg)) / cfg.vocab_size


def _gradients(cfg, h, t, b, ids, gv):
    safe, keep = distinct_targets(ids, cfg.vocab_size)
    dense = _dense_backward(h, t, b, ids, gv, cfg)
    sparse = _positives_backward(h, t, b, safe, keep, gv, cfg)
    return tuple(_add(x, y) for x, y in zip(dense, sparse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cut_bce(cfg, h, t, b, ids):
    return _per_row_loss(cfg, h, t, b, ids)


def _cut_bce_fwd(cfg, h, t, b, ids):
    return _per_row_loss(cfg, h, t, b, ids), (h, t, b, ids)


def _cut_bce_bwd(cfg, residuals, g):
    h, t, b, ids = residuals
    gv = g.astype(jnp.float32) / cfg.vocab_size
    return _grads_out(h, t, b, ids, _gradients(cfg, h, t, b, ids, gv))


_cut_bce.defvjp(_cut_bce_fwd, _cut_bce_bwd)


def _fused_loss_and_grads(cfg, h, t, b, ids, w):
    """`(sum_m w_m loss_m, float32 gradients at cotangent 1)`: one logits pass when it fits."""
    gv = w / cfg.vocab_size
    if not _fused_fits(h.shape[0], h.shape[1], cfg):  # three logits passes
        dense = _dense_forward(h, t, b, ids, cfg)
        grads = _dense_backward(h, t, b, ids, gv, cfg)
    else:
        dense, *grads = _dense_fused(h, t, b, ids, gv, cfg)
    safe, keep = distinct_targets(ids, cfg.vocab_size)
    loss = (dense + _positives_forward(h, t, b, safe, keep, cfg)) / cfg.vocab_size
    sparse = _positives_backward(h, t, b, safe, keep, gv, cfg)
    return jnp.vdot(w, loss), tuple(_add(x, y) for x, y in zip(grads, sparse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_sum(cfg, h, t, b, ids, w):
    # Plain evaluation (no gradient asked): the loss alone.
    return jnp.vdot(w, _per_row_loss(cfg, h, t, b, ids))


def _weighted_sum_fwd(cfg, h, t, b, ids, w):
    total, grads = _fused_loss_and_grads(cfg, h, t, b, ids, w)
    return total, (grads, h, t, b, ids, jnp.zeros_like(w))


def _weighted_sum_bwd(cfg, residuals, c):
    grads, h, t, b, ids, zero_w = residuals
    c = c.astype(jnp.float32)
    scaled = tuple(None if x is None else c * x for x in grads)
    return _grads_out(h, t, b, ids, scaled) + (zero_w,)


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


# ----------------------------------------------------------------------------
# Public functions.
# ----------------------------------------------------------------------------


def _matmul_dtype(hidden, table):
    """The hidden states' dtype when it is 16-bit (mixed precision), else the promoted one."""
    if jnp.dtype(hidden.dtype).itemsize == 2:
        return jnp.dtype(hidden.dtype).name
    return jnp.result_type(hidden.dtype, table.dtype).name


def _prepare(hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows,
             interpret):
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    bias = None if bias is None else jnp.asarray(bias)
    vocab_size = table.shape[0]
    ids = ids_as_int32(ids, vocab_size)  # out-of-range ids (any width) are padding
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.shape[1] == 0:  # No positives: one padding id keeps shapes non-empty.
        ids = jnp.full((hidden.shape[0], 1), -1, jnp.int32)
    num_rows, dim = hidden.shape
    mm_dtype = _matmul_dtype(hidden, table)
    tm, tv = choose_tiles(num_rows, vocab_size, dim, mm_dtype)
    if chunk_size is not None:
        tv = min(_round_up(chunk_size, LANES), _round_up(vocab_size, LANES))
    if block_rows is not None:
        tm = min(_round_up(block_rows, LANES), _round_up(max(num_rows, 1), LANES))
    if interpret is None:
        interpret = not _on_tpu()
    cfg = _Config(
        vocab_size=int(vocab_size),
        coef=bce_coefficients(label_smoothing, pos_weight),
        row_tile=int(tm),
        vocab_tile=int(tv),
        num_ids=int(ids.shape[1]),
        mm_dtype=mm_dtype,
        interpret=bool(interpret),
    )
    return cfg, hidden, table, bias, ids


def cut_bce(
    hidden,
    table,
    ids,
    bias=None,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    block_rows=None,
    interpret=None,
):
    """Per-row CutBCE `[M]` float32 with Pallas TPU kernels (exact gradients for any cotangent).

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        ids: integer `[M, L]`; ids outside `[0, V)` are padding (int64 ids
            included: they are never wrapped), duplicates count once.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile (rounded up to 128); None: the module's rule.
        block_rows: row tile (rounded up to 128); None: the module's rule.
        interpret: run the kernels in the Pallas TPU interpreter; None: when
            the default device is not a TPU.

    Returns:
        Float32 `[M]`: `mean_v[scale_v softplus(z_v) - target_v z_v]`.

    Example:

    >>> import numpy as np
    >>> h = np.zeros((3, 4), "float32"); table = np.zeros((10, 4), "float32")
    >>> loss = cut_bce(h, table, np.array([[1], [2], [-1]]), None)
    >>> bool(np.allclose(loss, np.log(2.0)))
    True
    """
    cfg, hidden, table, bias, ids = _prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret
    )
    if hidden.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32)
    return _cut_bce(cfg, hidden, table, bias, ids)


def cut_bce_weighted_sum(
    hidden,
    table,
    ids,
    bias,
    row_weights,
    *,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    block_rows=None,
    interpret=None,
):
    """`sum_m row_weights[m] * cut_bce(...)[m]`, its gradients computed with the loss.

    The fused training path of a reduced loss (`keras_cutbce.ops`): when a
    gradient is asked for, one Pallas kernel (kernel 4 of the module) makes
    one pass over the logits computing the loss and the gradients of
    `hidden`, `table` and `bias` at cotangent 1; the backward pass only
    scales them. Plain evaluation runs the forward kernel alone.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        ids: integer `[M, L]`; ids outside `[0, V)` are padding, duplicates count once.
        bias: float `[V]` or None.
        row_weights: float `[M]` row weights (constants: their gradient is 0).
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile (rounded up to 128); None: the module's rule.
        block_rows: row tile (rounded up to 128); None: the module's rule.
        interpret: run the kernels in the Pallas TPU interpreter; None: off TPU.

    Returns:
        A float32 scalar, differentiable w.r.t. `hidden`, `table` and `bias`.

    Example:

    >>> import numpy as np
    >>> h = np.zeros((3, 4), "float32"); table = np.zeros((10, 4), "float32")
    >>> w = np.array([1.0, 0.5, 0.0], "float32")
    >>> total = cut_bce_weighted_sum(h, table, np.array([[1], [2], [-1]]), None, w)
    >>> bool(np.isclose(total, 1.5 * np.log(2.0)))
    True
    """
    cfg, hidden, table, bias, ids = _prepare(
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret
    )
    weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return _weighted_sum(cfg, hidden, table, bias, ids, weights)
