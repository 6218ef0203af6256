"""CutBCE as Pallas TPU (Mosaic) kernels, under `jax.custom_vjp`.

The loss of a row is `(1 / V) * sum_v term(z_v)`, computed by Pallas
kernels over a grid of (row tiles, vocabulary tiles); a `[tm, tv]` logits
tile exists only in VMEM, float32 accumulators live in VMEM. Each logit's
term is exact for its role:

- a negative: `neg_scale * softplus(z) - neg_target * z`;
- a positive (the column is one of the row's ids, found by `L` vector
  compares per logit against the row's `[tm, L]` ids; padding ids never
  match, duplicates match once): `pos_minus softplus(-z) + pos_plus
  softplus(z)`, two non-negative parts, so a saturated positive (|z| = 1e4,
  a row of loss 1e-43) keeps float32 precision; its derivative is
  `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.

So the positives need no gather or scatter over the table (on TPU, XLA
offloads those to the SparseCore and relays the whole table out for them).
The coefficients come from `keras_cutbce.coefficients.bce_coefficients`.
One `exp` and one `log1p` per logit (`e = exp(-|z|)`, `softplus(+-z) =
max(+-z, 0) + log1p(e)`, `sigmoid(z) = 1 / (1 + e)` or `e / (1 + e)`), in
float32, so the loss and its gradients stay finite for any `|z|`; the fused
kernel shares the one `exp` between the loss and the gradient.

Kernels (all recompute the logits `z = h @ E.T + b`; matmuls run in the
matmul dtype with float32 accumulation: the hidden states' dtype when it is
16-bit (Keras mixed precision: bfloat16 activations, float32 table; the
table tile is cast in VMEM), else the promoted dtype; float32 matmuls at
`precision="default"`, what Keras's dense BCE gets on a TPU, or
`"highest"` (3-6 bf16 MXU passes) when asked):

1. forward, grid `(rows, vocab)`: the per-row sum of the terms.
2. `grad_hidden`, grid `(rows, vocab)`: `sum_v dz[m, v] E_v`,
   `dz = g_m term'(z)`.
3. `grad_table` and `grad_bias`, grid `(vocab, rows)` (transposed):
   `sum_m dz[m, v] h_m` and `sum_m dz[m, v]` accumulated over row tiles.
4. fused (the training path of a reduced loss, `cut_bce_weighted_sum`),
   grid `(vocab, rows)`: the loss and the three gradients for constant row
   weights in ONE pass over the logits. The table and bias gradient blocks
   accumulate over the inner row axis; the loss and hidden gradient of every
   row stay resident in VMEM for the whole grid (`[M, 128 + D]` float32).
   When they do not fit in a quarter of the VMEM budget, the fused path runs
   kernels 1-3 instead (three logits passes).

The table is never padded, copied or relaid out: the grid covers
`cdiv(V, tv)` tiles and the last, partial tile is masked in the kernels (its
out-of-range items are zeroed before any product, its columns masked out of
every sum; the masks exist only when V is not a multiple of the tile). Only
the rows (hidden states, ids, cotangent: `O(M (D + L))`) are padded to the
row tile; padded rows have zero weight. The table gradient is written in the
table's dtype (float32 accumulation in VMEM, one rounding at the end: the
same numbers as a float32 gradient cast afterwards; a backward cotangent
`c != 1` of the fused path then scales the rounded gradient, one more
rounding for a bfloat16 table).

Layout: XLA:TPU stores a narrow table `[V, D]` (`D % 128 != 0`) with V on
the lanes, so the kernels read it as its `[D, V]` view (a bitcast: blocks
`(D, tv)`, logits `h @ E_tile`, table gradient `h.T @ dz` written `[D, V]`
and viewed back); a table with `D % 128 == 0` is row-major and is read as
`[V, D]` (blocks `(tv, D)`, table gradient `dz.T @ h` as a transposed-LHS
matmul, no explicit transpose). Measured by compiling for v6e, value and
gradients of the weighted loss at (M, D, V) = (4096, 64, 876000) float32:
HBM temporaries 876 MiB before (two padded `[V, 128]` copies for the row-major
kernels, the positives' gather/scatter relayouts), 0 after; D = 128: 0;
bfloat16 D = 64: 0. Per-row vectors (the forward output, the cotangent)
travel lane-broadcast as `[rows, 128]` float32 arrays, the bias as a `[1, V]`
float32 row.

Dispatch (`keras_cutbce.backends.jax.tpu_target`): the kernels compile with
Mosaic when the program is compiled for a TPU and run in the Pallas
interpreter otherwise (or whenever `interpret=True`); when the target is
only known at lowering (a CPU host with libtpu, no mesh), both are traced and
`jax.lax.platform_dependent` keeps the target's (the effect-free
`interpret=True` interpreter there).

Tile rule (`chunk_size=None`, `block_rows=None`):

- VMEM budget: half the target TPU's VMEM per TensorCore (v4 16 MiB, v5e and
  v6e 128 MiB, v5p 64 MiB: `tpu_target.chip_info`, from the device kind of
  the trace's mesh, `jax.default_device` or the host's TPU), and then the
  kernels ask Mosaic for `vmem_limit_bytes = 3/4 x capacity`; for an unknown
  generation 12 MiB, three quarters of 16 MiB, the smallest default scoped
  VMEM of current TPUs, leaving headroom for Mosaic's own temporaries.
- Row tile `tm`: `min(512, M rounded up to 128)`; vocabulary tile `tv`: the
  widest multiple of 128, at most 4096 and at most `V` rounded up to 128,
  whose estimated footprint fits the budget. The estimate counts
  double-buffered input tiles in the input dtype (`2 (tm + tv) D itemsize`),
  float32 accumulators and output buffers (`3 (tm + tv) D * 4`) and five
  float32 `[tm, tv]` intermediates. If no `tv` fits, `tm` halves (down to
  128).
- Both tiles are multiples of 128: MXU- and lane-aligned, a multiple of the
  8/16 sublanes of float32/bfloat16. `chunk_size` overrides `tv` and
  `block_rows` overrides `tm` (both rounded up to 128).

Every `pallas_call` carries a `pl.CostEstimate` (matmul FLOPs,
transcendentals, table and row bytes) so XLA schedules around it.

Roofline (design target, not measured on a chip: nothing here has run on a
TPU): at (4096, 64, 876000) the fused step is 3 matmuls x 2 D FLOP per logit
over 3.59e9 logits = 1.38e12 FLOP. At D = 64 the contraction fills a
quarter of v6e's 256-deep MXU, so ~25% of its 918 TFLOP/s (bfloat16 passes,
float32 at default precision) is the ceiling: ~6 ms is the floor there. The
per-logit vector work (one `exp`, one `log1p`, one reciprocal and ~30 VPU
ops: compares, selects, the `L` id compares) is of the same order, so the
kernels are designed to be MXU/VPU-bound with the table streamed from HBM
once per pass (0.22 GiB at float32; 1.4 ms at v6e's 1.6 TB/s), never
HBM-bound on logits, which never leave VMEM.

Portability (JAX 0.10.2 and 0.11+): `pltpu.CompilerParams` was once
`pltpu.TPUCompilerParams`, `pltpu.InterpretParams` is recent; each is looked
up with `getattr` and has a fallback. Grid semantics are given as the
strings `"parallel"` / `"arbitrary"`, accepted by every version.

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

from keras_cutbce.backends.jax import tpu_target
from keras_cutbce.coefficients import BCECoefficients, bce_coefficients
from keras_cutbce.common import ids_as_int32
from keras_cutbce.common import round_up as _round_up

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_VOCAB_TILE = 4096
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20
DEFAULT_VMEM_BUDGET_BYTES = DEFAULT_SCOPED_VMEM_BYTES * 3 // 4

# `x @ y.T` ("NT") and `x.T @ y` ("TN") without materialising a transpose.
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def vmem_capacity_bytes():
    """VMEM bytes of one TensorCore of the target TPU, or None (not a TPU, unknown generation)."""
    chip = tpu_target.target_chip()
    return None if chip is None else chip.vmem_bytes


def vmem_budget_bytes(capacity=None):
    """The tiles' VMEM budget: half the target's VMEM, else `DEFAULT_VMEM_BUDGET_BYTES`."""
    return DEFAULT_VMEM_BUDGET_BYTES if capacity is None else capacity // 2


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
        budget_bytes = vmem_budget_bytes(vmem_capacity_bytes())
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
    """The `interpret=` value for `pl.pallas_call` (None: the compilation target decides)."""
    if interpret is None:
        interpret = tpu_target.target_platform() != "tpu"
    if not interpret:
        return False
    params = getattr(pltpu, "InterpretParams", None)  # JAX >= 0.6; else the generic interpreter.
    return params() if params is not None else True


def _compiler_params(semantics, vmem_capacity):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    kwargs = dict(dimension_semantics=semantics)
    if vmem_capacity is not None:
        kwargs["vmem_limit_bytes"] = int(vmem_capacity * 3 // 4)
    return cls(**kwargs)



class _Config(NamedTuple):
    """Static (hashable) settings of one call."""

    vocab_size: int
    coef: BCECoefficients
    row_tile: int
    vocab_tile: int
    num_ids: int
    mm_dtype: str
    interpret: object  # True, False, or None: by the compilation target
    vmem_capacity: object  # the target's VMEM bytes per TensorCore, or None: unknown
    precision: object  # lax.Precision of float32 matmuls (None: DEFAULT)
    table_dtype: str  # dtype of the table gradient the kernels write
    dv_view: bool  # the kernels read the table as its `[D, V]` view (D % 128 != 0)


# ----------------------------------------------------------------------------
# In-kernel math: the one fused tile function and the per-logit terms.
# ----------------------------------------------------------------------------


def _precision(dtype, cfg):
    return cfg.precision if jnp.dtype(dtype) == jnp.float32 else None


def _matmul(x, y, dims, cfg):
    """`dot_general` in the matmul dtype, float32 accumulation."""
    dtype = jnp.dtype(cfg.mm_dtype)
    return lax.dot_general(
        x.astype(dtype), y.astype(dtype), dims, precision=_precision(dtype, cfg),
        preferred_element_type=jnp.float32,
    )


def _table_tile(t_ref, j, cfg):
    """The table tile (`[D, tv]` or `[tv, D]`); items past V (last tile) are zeroed."""
    t = t_ref[...]
    if cfg.vocab_size % cfg.vocab_tile:
        items = lax.broadcasted_iota(jnp.int32, t.shape, 1 if cfg.dv_view else 0)
        t = jnp.where(items + j * cfg.vocab_tile < cfg.vocab_size, t, jnp.zeros_like(t))
    return t


def _logits_dims(cfg):
    """`h @ t` for a `[D, tv]` tile, `h @ t.T` for a `[tv, D]` one."""
    return _NN if cfg.dv_view else _NT


def _grad_hidden_tile(dz, t, cfg):
    """`dz @ E_tile`, `[tm, D]`."""
    return _matmul(dz, t, _NT if cfg.dv_view else _NN, cfg)


def _grad_table_tile(h, dz, cfg):
    """The table gradient tile in the table view's layout, no transpose of `dz`."""
    return _matmul(h, dz, _TN, cfg) if cfg.dv_view else _matmul(dz, h, _TN, cfg)


def _masks(ids_ref, shape, j, cfg):
    """`(valid, positive)` bool `[tm, tv]` of a tile (valid is None when every column is).

    `valid`: columns below V (only the last tile of an unaligned V has
    others). `positive`: the column is one of the row's ids (compared one id
    column at a time; padding ids never match, duplicates match once).
    """
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + j * cfg.vocab_tile
    valid = cols < cfg.vocab_size if cfg.vocab_size % cfg.vocab_tile else None
    positive = cols == ids_ref[:, 0:1]
    for k in range(1, cfg.num_ids):
        positive = jnp.logical_or(positive, cols == ids_ref[:, k : k + 1])
    return valid, positive


def _tile_logits(h, t, b_ref, cfg):
    """Float32 logits `[tm, tv]` of a row tile `h` against a `[D, tv]` table tile `t`."""
    z = _matmul(h, t, _logits_dims(cfg), cfg)
    if b_ref is not None:
        z = z + b_ref[...]
    return z


def _softplus_parts(z):
    """`(max(z, 0), max(-z, 0), e, log1p(e))` with `e = exp(-|z|)`: one exp, one log1p."""
    e = jnp.exp(-jnp.abs(z))
    return jnp.maximum(z, 0.0), jnp.maximum(-z, 0.0), e, jnp.log1p(e)


def _terms(z, positive, coef, parts=None):
    """Each logit's exact loss term.

    Negatives: `neg_scale softplus(z) - neg_target z`; positives:
    `pos_minus softplus(-z) + pos_plus softplus(z)` (non-negative parts, so a
    saturated positive keeps float32 precision).
    """
    relu, relu_neg, _, log1p_e = _softplus_parts(z) if parts is None else parts
    sp, sp_neg = relu + log1p_e, relu_neg + log1p_e
    neg = sp if coef.neg_scale == 1.0 else coef.neg_scale * sp
    neg = neg if coef.neg_target == 0.0 else neg - coef.neg_target * z
    pos = coef.pos_minus * sp_neg
    pos = pos if coef.pos_plus == 0.0 else pos + coef.pos_plus * sp
    return jnp.where(positive, pos, neg)


def _slopes(z, positive, coef, parts=None):
    """Each term's exact derivative in z.

    Negatives: `neg_scale sigmoid(z) - neg_target`; positives:
    `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.
    """
    e = jnp.exp(-jnp.abs(z)) if parts is None else parts[2]
    inv = 1.0 / (1.0 + e)
    sig, sig_neg = jnp.where(z >= 0, inv, e * inv), jnp.where(z >= 0, e * inv, inv)
    neg = sig if coef.neg_scale == 1.0 else coef.neg_scale * sig
    neg = neg if coef.neg_target == 0.0 else neg - coef.neg_target
    pos = coef.pos_plus - (coef.pos_plus + coef.pos_minus) * sig_neg
    return jnp.where(positive, pos, neg)


def _masked(x, valid):
    return x if valid is None else jnp.where(valid, x, 0.0)


def _unpack(refs, has_bias, has_weights):
    """Splits kernel refs into `(h, t, ids, bias | None, g | None, outputs_and_scratch)`."""
    refs = list(refs)
    h_ref, t_ref, ids_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    g_ref = refs.pop(0) if has_weights else None
    return h_ref, t_ref, ids_ref, b_ref, g_ref, refs


def _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg):
    """`(h, t, z, (valid, positive))` of one (row tile, vocabulary tile)."""
    h, t = h_ref[...], _table_tile(t_ref, j, cfg)
    z = _tile_logits(h, t, b_ref, cfg)
    return h, t, z, _masks(ids_ref, z.shape, j, cfg)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _forward_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, ids_ref, b_ref, _, (out_ref, acc_ref) = _unpack(refs, has_bias, False)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _, _, z, (valid, positive) = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    term = _masked(_terms(z, positive, cfg.coef), valid)
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

    _, t, z, (valid, positive) = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    dz = _masked(g_ref[:, :1] * _slopes(z, positive, cfg.coef), valid)
    acc_ref[...] += _grad_hidden_tile(dz, t, cfg)

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

    h, _, z, (valid, positive) = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    # Padded rows carry a zero cotangent, so they add nothing.
    dz = _masked(g_ref[:, :1] * _slopes(z, positive, cfg.coef), valid)
    acc_t_ref[...] += _grad_table_tile(h, dz, cfg)
    if has_bias:
        acc_b_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dt_ref[...] = acc_t_ref[...].astype(dt_ref.dtype)
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

    h, t, z, (valid, positive) = _tile(h_ref, t_ref, ids_ref, b_ref, j, cfg)
    parts = _softplus_parts(z)  # one exp per logit for the loss and the gradient
    term = _masked(_terms(z, positive, cfg.coef, parts), valid)
    loss_ref[rows, :] += jnp.sum(term, axis=1, keepdims=True) + jnp.zeros((1, LANES), jnp.float32)
    dz = _masked(g_ref[:, :1] * _slopes(z, positive, cfg.coef, parts), valid)
    dh_ref[rows, :] += _grad_hidden_tile(dz, t, cfg)
    acc_t_ref[...] += _grad_table_tile(h, dz, cfg)
    if has_bias:
        acc_b_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dt_ref[...] = acc_t_ref[...].astype(dt_ref.dtype)
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
        _table_spec(cfg, d, at(lambda i, j: j)),
        pl.BlockSpec((tm, length), at(lambda i, j: (i, 0))),
    ]
    if has_bias:
        specs.append(pl.BlockSpec((1, tv), at(lambda i, j: (0, j))))
    if has_weights:
        specs.append(pl.BlockSpec((tm, LANES), at(lambda i, j: (i, 0))))
    return specs


def _cost(cfg, mp, d, itemsize, matmuls, transcendentals):
    """`pl.CostEstimate` of one pass over the `[mp, V]` logits (for XLA's scheduler)."""
    logits = mp * cfg.vocab_size
    return pl.CostEstimate(
        flops=int(2 * logits * d * matmuls + 12 * logits),
        transcendentals=int(transcendentals * logits),
        bytes_accessed=int(cfg.vocab_size * d * itemsize * (1 + matmuls // 2)
                           + mp * (d * itemsize + 4 * cfg.num_ids + 4 * LANES)),
    )


def _table_spec(cfg, d, tile_index):
    """BlockSpec of a table-shaped array in the kernels' view, at vocabulary tile `tile_index`."""
    if cfg.dv_view:
        return pl.BlockSpec((d, cfg.vocab_tile), lambda *g: (0, tile_index(*g)))
    return pl.BlockSpec((cfg.vocab_tile, d), lambda *g: (tile_index(*g), 0))


def _table_view(t, cfg):
    """The table as the kernels read it: `[D, V]` (a layout bitcast on TPU) or `[V, D]`."""
    return t.T if cfg.dv_view else t


def _call(kernel, name, grid, in_specs, out_specs, out_shape, scratch, semantics, cfg, has_bias,
          cost):
    """The kernel as a function of its inputs: Mosaic on a TPU target, else the interpreter."""

    def build(interpret, plain=False):
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg, has_bias=has_bias),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=scratch,
            compiler_params=_compiler_params(semantics, None if interpret else cfg.vmem_capacity),
            interpret=True if plain else _interpret_arg(interpret),
            cost_estimate=cost,
            name=name,
        )

    if cfg.interpret is None:  # target unknown at trace time: decided at lowering
        # The plain (effect-free) interpreter: `platform_dependent` cannot drop
        # the ordered effects of `pltpu.InterpretParams`'s callbacks.
        return lambda *args: tpu_target.by_target(args, build(False), build(True, plain=True))
    return build(cfg.interpret)


def _table_grad_outputs(cfg, d, has_bias, index):
    """Out specs/shapes/scratch of the table (and bias) gradient, blocks at vocab tile `index`."""
    tv, vocab = cfg.vocab_tile, cfg.vocab_size
    specs = [_table_spec(cfg, d, index)]
    shape = (d, vocab) if cfg.dv_view else (vocab, d)
    shapes = [jax.ShapeDtypeStruct(shape, cfg.table_dtype)]
    scratch = [pltpu.VMEM(specs[0].block_shape, jnp.float32)]
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
        ("parallel", "arbitrary"), cfg, has_bias, _cost(cfg, mp, d, t.dtype.itemsize, 1, 2),
    )(*([hp, _table_view(t, cfg), idsp] + ([_bias_row(b)] if has_bias else [])))
    return out[: h.shape[0], 0]


def _dense_backward(h, t, b, ids, g, cfg):
    """`(grad_hidden [M, D], grad_table (the kernels' view), grad_bias [V] | None)` (kernels 2, 3)."""
    hp, idsp, gp = _row_inputs(h, ids, g, cfg)
    mp, d = hp.shape
    has_bias = b is not None
    inputs = [hp, _table_view(t, cfg), idsp] + ([_bias_row(b)] if has_bias else []) + [gp]
    rows, tiles = _grid_sizes(mp, cfg)
    grad_h = _call(
        _grad_hidden_kernel, "cutbce_grad_hidden", (rows, tiles),
        _specs(cfg, d, has_bias, True, False),
        pl.BlockSpec((cfg.row_tile, d), lambda i, j: (i, 0)),
        jax.ShapeDtypeStruct((mp, d), jnp.float32),
        [pltpu.VMEM((cfg.row_tile, d), jnp.float32)],
        ("parallel", "arbitrary"), cfg, has_bias, _cost(cfg, mp, d, t.dtype.itemsize, 2, 1),
    )(*inputs)
    # Transposed grid (vocab tile j, row tile i): the table gradient is
    # accumulated over row tiles while its block stays in VMEM.
    specs, shapes, scratch = _table_grad_outputs(cfg, d, has_bias, lambda j, i: j)
    outs = _call(
        _grad_table_kernel, "cutbce_grad_table", (tiles, rows),
        _specs(cfg, d, has_bias, True, True), specs, shapes, scratch,
        ("parallel", "arbitrary"), cfg, has_bias, _cost(cfg, mp, d, t.dtype.itemsize, 2, 1),
    )(*inputs)
    grad_b = outs[1][0] if has_bias else None
    return grad_h[: h.shape[0]], outs[0], grad_b


def _fused_fits(num_rows, dim, cfg):
    """Whether the fused kernel's resident `[M, 128 + D]` float32 rows fit its VMEM share."""
    budget = vmem_budget_bytes(cfg.vmem_capacity)
    mp = _round_up(num_rows, cfg.row_tile)
    return 2 * mp * (LANES + dim) * 4 <= budget // 4


def _dense_fused(h, t, b, ids, w, cfg):
    """Kernel 4: `(negatives [M], grad_hidden, grad_table (view), grad_bias | None)`, one pass."""
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
        _cost(cfg, mp, d, t.dtype.itemsize, 3, 2),
    )(*([hp, _table_view(t, cfg), idsp] + ([_bias_row(b)] if has_bias else []) + [gp]))
    num_rows = h.shape[0]
    grad_b = outs[3][0] if has_bias else None
    return outs[0][:num_rows, 0], outs[1][:num_rows], outs[2], grad_b


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
    return _dense_forward(h, t, b, ids, cfg) / cfg.vocab_size


def _table_layout(grads, cfg):
    """`(dh, dt, db)` with the table gradient back as `[V, D]` (a bitcast on TPU)."""
    dh, dt, db = grads
    return dh, _table_view(dt, cfg), db


def _gradients(cfg, h, t, b, ids, gv):
    return _table_layout(_dense_backward(h, t, b, ids, gv, cfg), cfg)


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
        sums = _dense_forward(h, t, b, ids, cfg)
        grads = _dense_backward(h, t, b, ids, gv, cfg)
    else:
        sums, *grads = _dense_fused(h, t, b, ids, gv, cfg)
    return jnp.vdot(w, sums / cfg.vocab_size), _table_layout(grads, cfg)


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


_PRECISIONS = {"default": None, "highest": lax.Precision.HIGHEST}


def _resolve_interpret(interpret):
    """True/False when asked or when the target is known at trace time, else None."""
    if interpret is not None:
        return bool(interpret)
    platform = tpu_target.target_platform()
    return None if platform is None else platform != "tpu"


def _prepare(hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows,
             interpret, precision="default"):
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    bias = None if bias is None else jnp.asarray(bias)
    vocab_size = table.shape[0]
    ids = ids_as_int32(ids, vocab_size)  # out-of-range ids (any width) are padding
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.shape[1] == 0:  # No positives: one padding id keeps shapes non-empty.
        ids = jnp.full((hidden.shape[0], 1), -1, jnp.int32)
    if precision not in _PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {sorted(_PRECISIONS)}; received {precision!r}."
        )
    num_rows, dim = hidden.shape
    mm_dtype = _matmul_dtype(hidden, table)
    capacity = vmem_capacity_bytes()
    tm, tv = choose_tiles(num_rows, vocab_size, dim, mm_dtype, vmem_budget_bytes(capacity))
    if chunk_size is not None:
        tv = min(_round_up(chunk_size, LANES), _round_up(vocab_size, LANES))
    if block_rows is not None:
        tm = min(_round_up(block_rows, LANES), _round_up(max(num_rows, 1), LANES))
    cfg = _Config(
        vocab_size=int(vocab_size),
        coef=bce_coefficients(label_smoothing, pos_weight),
        row_tile=int(tm),
        vocab_tile=int(tv),
        num_ids=int(ids.shape[1]),
        mm_dtype=mm_dtype,
        interpret=_resolve_interpret(interpret),
        vmem_capacity=capacity,
        precision=_PRECISIONS[precision],
        table_dtype=jnp.dtype(table.dtype).name,
        dv_view=dim % LANES != 0,
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
    precision="default",
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
            the program is not compiled for a TPU (`tpu_target`).
        precision: `"default"` (float32 matmuls at the TPU's default
            precision, as Keras's dense BCE computes them) or `"highest"`.

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
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret,
        precision,
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
    precision="default",
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
        interpret: run the kernels in the Pallas TPU interpreter; None: when
            the program is not compiled for a TPU.
        precision: `"default"` or `"highest"` (float32 matmuls).

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
        hidden, table, ids, bias, label_smoothing, pos_weight, chunk_size, block_rows, interpret,
        precision,
    )
    weights = jnp.asarray(row_weights, jnp.float32).reshape(hidden.shape[:1])
    if hidden.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return _weighted_sum(cfg, hidden, table, bias, ids, weights)
