"""CutBCE as Pallas TPU (Mosaic) kernels, under `jax.custom_vjp`.

The loss of a row is `(1 / V) * sum_v term(z_v)`, computed by one Pallas
kernel that makes one pass over the table per block of resident rows; a
`[tm, tv]` logits tile exists only in VMEM, float32 accumulators live in
VMEM. Each logit's term is exact for its role:

- a negative: `neg_scale * softplus(z) - neg_target * z`;
- a positive (the column is one of the row's ids; each row's ids are
  sorted, so those inside a vocabulary tile are consecutive and each logit
  is compared with at most as many ids as the tile's most crowded row has
  there, a prefetched count: 1.25 on average for 8 uniform ids at 876k
  items, not 8; padding ids never match, duplicates match once):
  `pos_minus softplus(-z) + pos_plus softplus(z)`, two non-negative parts,
  so a saturated positive (|z| = 1e4, a row of loss 1e-43) keeps float32
  precision; its derivative is
  `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.

So the positives need no gather or scatter over the table (on TPU, XLA
offloads those to the SparseCore and relays the whole table out for them).
The coefficients come from `keras_cutbce.math.coefficients.bce_coefficients`.
One `exp` and one `log1p` per logit (`e = exp(-|z|)`, `softplus(+-z) =
max(+-z, 0) + log1p(e)`, `sigmoid(z) = 1 / (1 + e)` or `e / (1 + e)`), in
float32, so the loss and its gradients stay finite for any `|z|`; the fused
kernel shares the one `exp` between the loss and the gradient.

Every pass recomputes the logits `z = h @ E.T + b` (matmuls in the
matmul dtype with float32 accumulation: the hidden states' dtype when it is
16-bit (Keras mixed precision: bfloat16 activations, float32 table; the
table tile is cast in VMEM), else the promoted dtype; float32 matmuls at
`precision="default"`, what Keras's dense BCE gets on a TPU, or
`"highest"` (3-6 bf16 MXU passes) when asked).

One kernel (`_kernel`), three uses: the forward (the rows' loss sums),
the gradients under any row cotangent (the per-row loss's backward), and
both in ONE pass (the training path of a reduced loss,
`cut_bce_weighted_sum`: the backward pass then only scales the saved
gradients). Its grid is `(core, vocabulary tile, row tile)`:

- the rows are resident: hidden states, ids `[L, mb]` and row weights
  `[1, mb]` are fetched once per pass, and the loss `[1, mb]` and hidden
  gradient (`[D, mb]` or `[mb, D]`, the table view's layout) stay in VMEM
  for the whole pass, written back once. Per-row values travel lane-dense;
  the kernel moves them to and from the sublanes with one 128-aligned
  transpose per tile (`[L, tm]`, `[1, tm]`, `[tm, 1]`: O(tm L) work
  against the tile's O(tm tv)).
- the table tile and its gradient accumulator stay in VMEM across the
  inner row axis, so a pass reads the table once and writes its gradient
  once.
- rows beyond one resident block (`row_blocks`: the rows' double-buffered
  bytes within a quarter of the VMEM budget; at D = 64 float32 about 13.8k
  rows on v5e/v6e, 6.9k on v5p, 1.7k on v4) run one pass per block; the
  table and bias gradients of block k are inputs of block k + 1, aliased
  to its outputs, so they accumulate in place (written in the table's
  dtype: a bfloat16 table's gradient is rounded once per block, not once;
  a float32 copy would be a table-sized temporary).
- megacore (v4, v5p: one device, two TensorCores): the leading grid axis
  is "parallel" over the cores, each taking a contiguous half of the
  vocabulary tiles (the second core's step past the last tile, when the
  count is odd, does nothing); each core writes its own loss and hidden
  gradient partials (`[cores, ...]`, summed by XLA: O(M D)). On one-core
  chips the axis has size 1.

Measured from the kernels' pipeline schedule for v6e
(`benchmarks/pallas_traffic.py`; bytes the kernels move, nothing timed),
value and gradients, (M, D, V) = (4096, 64, 876000) float32: the reduced
loss moves 0.42 GiB (1.07 before: row inputs re-fetched per vocabulary
tile, 0.65 GiB of them), the per-row loss 0.63 GiB (4.42 before: three
kernels, the table read 17 times); M = 16384: 1.05 GiB, the table read
twice and its gradient carried once (16.4 GiB before, the table read 65
times).

The table is never padded, copied or relaid out: the grid covers
`cdiv(V, tv)` tiles and the last, partial tile is masked in the kernel (its
out-of-range items are zeroed before any product, its columns masked out of
every sum; the masks run on that tile only, the others take a branch
without them). Only the rows (hidden states, ids, cotangent: `O(M (D + L))`)
are padded to the row tile; padded rows have zero weight. The table
gradient is written in the table's dtype (float32 accumulation in VMEM, one
rounding per row block: the same numbers as a float32 gradient cast
afterwards when the rows fit one block; a backward cotangent `c != 1` of the
fused path then scales the rounded gradient, one more rounding for a
bfloat16 table).

Layout: XLA:TPU stores a narrow table `[V, D]` (`D % 128 != 0`) with V on
the lanes, so the kernels read it as its `[D, V]` view (a bitcast: blocks
`(D, tv)`, logits `h @ E_tile`, table gradient `h.T @ dz` written `[D, V]`
and viewed back); a table with `D % 128 == 0` is row-major and is read as
`[V, D]` (blocks `(tv, D)`, table gradient `dz.T @ h` as a transposed-LHS
matmul, no explicit transpose). Measured by compiling for v6e, value and
gradients of the weighted loss at (M, D, V) = (4096, 64, 876000) float32:
HBM temporaries 876 MiB before (two padded `[V, 128]` copies for the row-major
kernels, the positives' gather/scatter relayouts), 0 after; D = 128: 0;
bfloat16 D = 64: 0. The bias travels as a `[1, V]` float32 row.

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
HBM-bound on logits, which never leave VMEM. On megacore chips the two
TensorCores each take half of the vocabulary tiles.

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
from keras_cutbce.math.coefficients import BCECoefficients, bce_coefficients
from keras_cutbce.common import ids_as_int32
from keras_cutbce.common import round_up as _round_up

LANES = 128
PADDING_ID = np.iinfo(np.int32).max  # sorted ids: padding last, never a column
MAX_PREFETCHED_COUNTS = 2**14  # in-tile id counts kept per row tile up to 64 KiB of SMEM
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


def tensorcores():
    """TensorCores one device of the target TPU drives (2 on v4 and v5p megacore chips), else 1."""
    chip = tpu_target.target_chip()
    return 1 if chip is None else chip.cores


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
    cores: int = 1  # TensorCores of the target chip (the vocabulary is split across them)


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


def _table_tile(t_ref, tile, cfg, edge):
    """The table tile (`[D, tv]` or `[tv, D]`); on the `edge` tile, items past V are zeroed."""
    t = t_ref[...]
    if edge:
        items = lax.broadcasted_iota(jnp.int32, t.shape, 1 if cfg.dv_view else 0)
        t = jnp.where(items + tile * cfg.vocab_tile < cfg.vocab_size, t, jnp.zeros_like(t))
    return t


def _logits(h, t, b_ref, cfg):
    """Float32 logits `[tm, tv]`: `h.T @ t` (`[D, tm]` rows, `[D, tv]` tile) or `h @ t.T`."""
    z = _matmul(h, t, _TN if cfg.dv_view else _NT, cfg)
    if b_ref is not None:
        z = z + b_ref[...]
    return z


def _grad_hidden_tile(dz, t, cfg):
    """The hidden gradient of a tile in the rows' layout: `t @ dz.T` `[D, tm]` or `dz @ t`."""
    return _matmul(t, dz, _NT, cfg) if cfg.dv_view else _matmul(dz, t, _NN, cfg)


def _grad_table_tile(h, dz, cfg):
    """The table gradient tile in the table view's layout: `h @ dz` `[D, tv]` or `dz.T @ h`."""
    return _matmul(h, dz, _NN, cfg) if cfg.dv_view else _matmul(dz, h, _TN, cfg)


def _as_columns(rows, fill):
    """`[k, tm]` -> `[tm, k]` (one 128-aligned transpose: per-row values to the sublanes)."""
    k, tm = rows.shape
    padded = _round_up(k, LANES)
    if padded != k:
        rows = jnp.concatenate([rows, jnp.full((padded - k, tm), fill, rows.dtype)], axis=0)
    return jnp.transpose(rows)[:, :k]


def _as_row(column):
    """`[tm, 1]` -> `[1, tm]` (per-row values back to the lanes)."""
    return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], LANES)))[0:1, :]


def _masks(ids, in_tile, shape, tile, cfg, edge):
    """`(valid, positive)` bool `[tm, tv]` of a tile (valid is None when every column is).

    `valid`: columns below V, on the `edge` tile only (the last tile of an
    unaligned V). `positive`: the column is one of the row's ids. `ids` `[L, tm]`
    are each row's ids sorted ascending (padding sorted last as
    `PADDING_ID`), so the ids inside this tile are consecutive: row `m`'s
    start at `first[m]` (its ids below the tile, counted in O(L tm)), and
    no row has more than `in_tile` of them (a scalar from the kernel's
    prefetched counts, usually 0 or 1). One compare per logit per such id,
    not one per id of the row: padding ids never match, duplicates match
    once.
    """
    lo = tile * cfg.vocab_tile
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + lo
    valid = cols < cfg.vocab_size if edge else None
    first = jnp.sum((ids < lo).astype(jnp.int32), axis=0, keepdims=True)  # [1, tm]
    slot = lax.broadcasted_iota(jnp.int32, ids.shape, 0)

    def add(k, hits):  # int32, not bool: Mosaic cannot carry a mask vector through a loop
        pick = jnp.max(jnp.where(slot == first + k, ids, -1), axis=0, keepdims=True)
        return jnp.where(cols == _as_columns(pick, -1), 1, hits)

    return valid, lax.fori_loop(0, in_tile, add, jnp.zeros(shape, jnp.int32)) != 0


def _softplus_parts(z):
    """`(max(z, 0), max(-z, 0), e, log1p(e))` with `e = exp(-|z|)`: one exp, one log1p."""
    e = jnp.exp(-jnp.abs(z))
    return jnp.maximum(z, 0.0), jnp.maximum(-z, 0.0), e, jnp.log1p(e)


def _terms(z, positive, coef, parts):
    """Each logit's exact loss term.

    Negatives: `neg_scale softplus(z) - neg_target z`; positives:
    `pos_minus softplus(-z) + pos_plus softplus(z)` (non-negative parts, so a
    saturated positive keeps float32 precision).
    """
    relu, relu_neg, _, log1p_e = parts
    sp, sp_neg = relu + log1p_e, relu_neg + log1p_e
    neg = sp if coef.neg_scale == 1.0 else coef.neg_scale * sp
    neg = neg if coef.neg_target == 0.0 else neg - coef.neg_target * z
    pos = coef.pos_minus * sp_neg
    pos = pos if coef.pos_plus == 0.0 else pos + coef.pos_plus * sp
    return jnp.where(positive, pos, neg)


def _slopes(z, positive, coef, parts):
    """Each term's exact derivative in z.

    Negatives: `neg_scale sigmoid(z) - neg_target`; positives:
    `pos_plus - (pos_plus + pos_minus) sigmoid(-z)`.
    """
    e = parts[2]
    inv = 1.0 / (1.0 + e)
    sig, sig_neg = jnp.where(z >= 0, inv, e * inv), jnp.where(z >= 0, e * inv, inv)
    neg = sig if coef.neg_scale == 1.0 else coef.neg_scale * sig
    neg = neg if coef.neg_target == 0.0 else neg - coef.neg_target
    pos = coef.pos_plus - (coef.pos_plus + coef.pos_minus) * sig_neg
    return jnp.where(positive, pos, neg)


def _masked(x, valid):
    return x if valid is None else jnp.where(valid, x, 0.0)


class _Pass(NamedTuple):
    """Static shape of one kernel pass over the table for one block of resident rows."""

    has_bias: bool
    with_loss: bool  # write the rows' loss sums
    with_grads: bool  # write the hidden, table and bias gradients (rows weighted by `g`)
    carry: bool  # the table/bias gradients add to those of earlier row blocks (aliased inputs)
    block_rows: int  # resident rows of this pass (a multiple of the row tile)
    tiles_per_core: int  # vocabulary tiles a TensorCore visits (the last core may idle)
    counts_per_row_tile: bool  # in-tile id counts per (vocab tile, row tile), else per vocab tile


# ----------------------------------------------------------------------------
# The kernel: one pass over the table, grid (core, vocabulary tile, row tile).
# ----------------------------------------------------------------------------


def _kernel(*refs, cfg, ps):
    """Loss sums and/or gradients of one block of resident rows, one pass over the table.

    Grid `(c, j, i)`: TensorCore `c` ("parallel": megacore chips split the
    vocabulary across their two cores), its vocabulary tile `j`, row tile
    `i` of the resident block. The table tile and its gradient accumulator
    stay in VMEM across the inner row axis (the table is read once per
    pass); the rows (hidden states `[D, mb]` or `[mb, D]`, ids `[L, mb]`,
    weights `[1, mb]`) and their outputs (loss `[1, mb]`, hidden gradient
    in the rows' layout) are resident for the whole pass, one copy per core.
    """
    refs = list(refs)
    in_tile_ref, h_ref, ids_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    g_ref = refs.pop(0) if ps.with_grads else None
    t_ref = refs.pop(0)
    b_ref = refs.pop(0) if ps.has_bias else None
    dt_in = refs.pop(0) if ps.carry else None
    db_in = refs.pop(0) if ps.carry and ps.has_bias else None
    loss_ref = refs.pop(0) if ps.with_loss else None
    dh_ref = dt_ref = db_ref = acc_t = acc_b = None
    if ps.with_grads:
        dh_ref, dt_ref = refs.pop(0), refs.pop(0)
        db_ref = refs.pop(0) if ps.has_bias else None
        acc_t = refs.pop(0)
        acc_b = refs.pop(0) if ps.has_bias else None
    c, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = c * ps.tiles_per_core + j
    tm = cfg.row_tile
    rows = pl.ds(pl.multiple_of(i * tm, tm), tm)

    def hidden_rows(ref):
        return ref.at[:, rows] if cfg.dv_view else ref.at[rows, :]

    def body(edge):
        @pl.when(j == 0)
        def _init_rows():  # this core's first visit of these rows
            if ps.with_loss:
                loss_ref[:, rows] = jnp.zeros((1, tm), jnp.float32)
            if ps.with_grads:
                dh = hidden_rows(dh_ref)
                dh[...] = jnp.zeros(dh.shape, jnp.float32)

        if ps.with_grads:
            @pl.when(i == 0)
            def _init_tile():  # first row tile of this vocabulary tile
                start_t = dt_in[...].astype(jnp.float32) if ps.carry else 0.0
                acc_t[...] = jnp.zeros_like(acc_t) + start_t
                if ps.has_bias:
                    start_b = db_in[...] if ps.carry else 0.0
                    acc_b[...] = jnp.zeros_like(acc_b) + start_b

        h = hidden_rows(h_ref)[...]
        t = _table_tile(t_ref, tile, cfg, edge)
        z = _logits(h, t, b_ref, cfg)
        in_tile = in_tile_ref[tile * pl.num_programs(2) + i if ps.counts_per_row_tile else tile]
        valid, positive = _masks(ids_ref[:, rows], in_tile, z.shape, tile, cfg, edge)
        parts = _softplus_parts(z)  # one exp per logit for the loss and the gradient
        if ps.with_loss:
            term = _masked(_terms(z, positive, cfg.coef, parts), valid)
            loss_ref[:, rows] += _as_row(jnp.sum(term, axis=1, keepdims=True))
        if ps.with_grads:
            # Padded rows carry a zero weight, so they add nothing.
            g = _as_columns(g_ref[:, rows], 0.0)
            dz = _masked(g * _slopes(z, positive, cfg.coef, parts), valid)
            dh = hidden_rows(dh_ref)
            dh[...] += _grad_hidden_tile(dz, t, cfg)
            acc_t[...] += _grad_table_tile(h, dz, cfg)
            if ps.has_bias:
                acc_b[...] += jnp.sum(dz, axis=0, keepdims=True)

            @pl.when(i == pl.num_programs(2) - 1)
            def _store():
                dt_ref[...] = acc_t[...].astype(dt_ref.dtype)
                if ps.has_bias:
                    db_ref[...] = acc_b[...]

    # The edge masks run on the last tile of an unaligned V only; the last
    # core's steps past the last tile (their blocks clamped) do nothing.
    tiles = _num_tiles(cfg)
    if cfg.vocab_size % cfg.vocab_tile:
        pl.when(tile < tiles - 1)(lambda: body(False))
        pl.when(tile == tiles - 1)(lambda: body(True))
    elif ps.tiles_per_core * _cores_used(cfg) == tiles:
        body(False)
    else:
        pl.when(tile < tiles)(lambda: body(False))


# ----------------------------------------------------------------------------
# pallas_call wrappers: rows padded to the row tile, the table never padded.
# ----------------------------------------------------------------------------

_SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None


def _num_tiles(cfg):
    return pl.cdiv(cfg.vocab_size, cfg.vocab_tile)


def _cores_used(cfg):
    """TensorCores the vocabulary is split across (each gets at least one tile)."""
    return max(1, min(cfg.cores, _num_tiles(cfg)))


def _resident_bytes_per_row(dim, num_ids, hidden_itemsize, with_grads):
    """VMEM bytes a resident row costs a pass (double-buffered, sublane-padded rows)."""
    per_row = _round_up(dim, 16) * hidden_itemsize + _round_up(num_ids, 8) * 4 + 8 * 4  # h, ids, loss
    if with_grads:
        per_row += 8 * 4 + _round_up(dim, 8) * 4  # weights, hidden gradient
    return 2 * per_row


def _resident_budget_bytes(cfg):
    """The resident rows' VMEM share: a quarter of the tiles' budget."""
    return vmem_budget_bytes(cfg.vmem_capacity) // 4


def row_blocks(num_rows, dim, hidden_itemsize, cfg, with_grads=True):
    """`(count, block_rows)`: the resident row blocks a loss pass splits `num_rows` into.

    Each block is one pass over the table (one `pallas_call`); the table and
    bias gradients accumulate across blocks.
    """
    tm = cfg.row_tile
    mp = _round_up(max(num_rows, 1), tm)
    per_row = _resident_bytes_per_row(dim, cfg.num_ids, hidden_itemsize, with_grads)
    cap = max(tm, _resident_budget_bytes(cfg) // per_row // tm * tm)
    count = pl.cdiv(mp, cap)
    return count, _round_up(pl.cdiv(mp, count), tm)


def _pad_rows(x, rows, value=0):
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=value)


def _row_inputs(h, ids, g, rows, cfg):
    """Rows padded to `rows` in the kernels' layout: hidden `[D, rows]` or `[rows, D]`,
    ids `[L, rows]`, weights `[1, rows]` float32 (or None)."""
    hp = _pad_rows(h, rows)
    hp = hp.T if cfg.dv_view else hp
    idsp = _pad_rows(_sorted_ids(ids, cfg), rows, PADDING_ID).T
    gp = None if g is None else _pad_rows(g.astype(jnp.float32), rows)[None, :]
    return hp, idsp, gp


def _sorted_ids(ids, cfg):
    """Each row's ids ascending, padding (outside `[0, V)`) as `PADDING_ID` at the end."""
    real = jnp.logical_and(ids >= 0, ids < cfg.vocab_size)
    return jnp.sort(jnp.where(real, ids, PADDING_ID), axis=1)


def _in_tile_counts(ids_t, cfg):
    """`[tiles, row tiles]` int32: the most ids one row of the row tile has in the vocab tile.

    `ids_t`: sorted ids `[L, rows]` (`_row_inputs`). O(rows L): a row's ids
    in one tile are consecutive, so an id's rank among them is its slot
    minus the slot where its tile starts.
    """
    ids = ids_t.T
    rows, length = ids.shape
    tiles = _num_tiles(cfg)
    tile_of = jnp.where(ids < cfg.vocab_size, ids // cfg.vocab_tile, tiles)  # padding: dropped
    slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    starts = jnp.concatenate(
        [jnp.ones((rows, 1), bool), tile_of[:, 1:] != tile_of[:, :-1]], axis=1)
    rank = slot - lax.cummax(jnp.where(starts, slot, 0), axis=1)
    row_tile = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) // cfg.row_tile)[:, None],
                                ids.shape)
    counts = jnp.zeros((tiles, rows // cfg.row_tile), jnp.int32)
    return counts.at[tile_of, row_tile].max(rank + 1, mode="drop")


def _bias_row(b):
    return None if b is None else b.astype(jnp.float32).reshape(1, -1)


def _table_view(t, cfg):
    """The table as the kernels read it: `[D, V]` (a layout bitcast on TPU) or `[V, D]`."""
    return t.T if cfg.dv_view else t


def _cost(cfg, rows, d, itemsize, ps):
    """`pl.CostEstimate` of one pass over the `[rows, V]` logits (for XLA's scheduler)."""
    logits = rows * cfg.vocab_size
    matmuls = 3 if ps.with_grads else 1
    table = cfg.vocab_size * d
    grad_bytes = (table * 4 * (2 if ps.carry else 1)) if ps.with_grads else 0
    return pl.CostEstimate(
        flops=int(2 * logits * d * matmuls + 12 * logits),
        transcendentals=int(2 * logits),
        bytes_accessed=int(table * itemsize + grad_bytes
                           + rows * (d * itemsize + 4 * cfg.num_ids + 8 + 4 * d)),
    )


def _pass(hp, t, b, idsp, gp, counts, carried, block, ps, cfg):
    """One `pallas_call`: row block `block` of the padded rows against the whole table.

    Returns `(loss [mb] | None, grad_hidden (rows' layout) | None, grad_table
    (view) | None, grad_bias [1, V] | None)`; `counts` the block's in-tile
    id counts (prefetched to SMEM, flat); `carried` are the table/bias
    gradients of earlier blocks to add to, or None.
    """
    d = t.shape[1]
    tv, mb, per = cfg.vocab_tile, ps.block_rows, ps.tiles_per_core
    tiles, cores = _num_tiles(cfg), _cores_used(cfg)
    grid = (cores, per, mb // cfg.row_tile)

    def tile(c, j):
        return j if cores == 1 else jnp.minimum(c * per + j, tiles - 1)

    def table_spec():
        if cfg.dv_view:
            return pl.BlockSpec((d, tv), lambda c, j, i, *_: (0, tile(c, j)))
        return pl.BlockSpec((tv, d), lambda c, j, i, *_: (tile(c, j), 0))

    bias_spec = pl.BlockSpec((1, tv), lambda c, j, i, *_: (0, tile(c, j)))
    h_block = (d, mb) if cfg.dv_view else (mb, d)
    in_specs = [
        pl.BlockSpec(h_block, (lambda c, j, i, *_: (0, block)) if cfg.dv_view
                     else (lambda c, j, i, *_: (block, 0))),
        pl.BlockSpec((idsp.shape[0], mb), lambda c, j, i, *_: (0, block)),
    ]
    inputs = [hp, idsp]
    if ps.with_grads:
        in_specs.append(pl.BlockSpec((1, mb), lambda c, j, i, *_: (0, block)))
        inputs.append(gp)
    in_specs.append(table_spec())
    inputs.append(_table_view(t, cfg))
    if ps.has_bias:
        in_specs.append(bias_spec)
        inputs.append(_bias_row(b))
    if ps.carry:
        in_specs += [table_spec()] + ([bias_spec] if ps.has_bias else [])
        inputs += list(carried)
    out_specs, out_shapes, scratch = [], [], []
    if ps.with_loss:
        out_specs.append(pl.BlockSpec((_SQUEEZED, 1, mb), lambda c, j, i, *_: (c, 0, 0)))
        out_shapes.append(jax.ShapeDtypeStruct((cores, 1, mb), jnp.float32))
    aliases = {}
    if ps.with_grads:
        view = (d, cfg.vocab_size) if cfg.dv_view else (cfg.vocab_size, d)
        out_specs += [pl.BlockSpec((_SQUEEZED,) + h_block, lambda c, j, i, *_: (c, 0, 0)),
                      table_spec()]
        out_shapes += [jax.ShapeDtypeStruct((cores,) + h_block, jnp.float32),
                       jax.ShapeDtypeStruct(view, cfg.table_dtype)]
        scratch.append(pltpu.VMEM((d, tv) if cfg.dv_view else (tv, d), jnp.float32))
        if ps.has_bias:
            out_specs.append(bias_spec)
            out_shapes.append(jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32))
            scratch.append(pltpu.VMEM((1, tv), jnp.float32))
        if ps.carry:  # accumulate in place: the carried gradients' buffers are the outputs'
            first_out = 1 if ps.with_loss else 0
            carry_in = 1 + len(inputs) - len(carried)  # operand 0: the prefetched counts
            aliases = {carry_in + k: first_out + 1 + k for k in range(len(carried))}
    name = "cutbce_fused" if ps.with_loss and ps.with_grads else (
        "cutbce_grads" if ps.with_grads else "cutbce_forward")

    def build(interpret, plain=False):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch)
        return pl.pallas_call(
            functools.partial(_kernel, cfg=cfg, ps=ps),
            grid_spec=grid_spec,
            out_shape=out_shapes,
            # Mosaic only: the TPU interpreter mishandles aliased outputs with
            # a partial last block (JAX 0.10.2); without aliasing the numbers
            # are the same, only the carried buffers are not reused.
            input_output_aliases={} if interpret else aliases,
            compiler_params=_compiler_params(("parallel", "arbitrary", "arbitrary"),
                                             None if interpret else cfg.vmem_capacity),
            interpret=True if plain else _interpret_arg(interpret),
            cost_estimate=_cost(cfg, mb, d, t.dtype.itemsize, ps),
            name=name,
        )

    if cfg.interpret is None:  # target unknown at trace time: decided at lowering
        # The plain (effect-free) interpreter: `platform_dependent` cannot drop
        # the ordered effects of `pltpu.InterpretParams`'s callbacks.
        outs = tpu_target.by_target((counts, *inputs), build(False), build(True, plain=True))
    else:
        outs = build(cfg.interpret)(counts, *inputs)
    outs = list(outs)
    loss = outs.pop(0).sum(axis=0)[0] if ps.with_loss else None
    if not ps.with_grads:
        return loss, None, None, None
    dh, dt = outs[0].sum(axis=0), outs[1]
    return loss, dh, dt, (outs[2] if ps.has_bias else None)


def _passes(h, t, b, ids, g, cfg, with_loss):
    """Row loss sums `[M]` (or None) and `(grad_hidden [M, D], grad_table (view), grad_bias [V])`
    weighted by `g` (or None), one pass over the table per resident row block."""
    with_grads = g is not None
    count, mb = row_blocks(h.shape[0], h.shape[1], h.dtype.itemsize, cfg, with_grads)
    hp, idsp, gp = _row_inputs(h, ids, g, count * mb, cfg)
    per = pl.cdiv(_num_tiles(cfg), _cores_used(cfg))
    counts = _in_tile_counts(idsp, cfg)
    row_tiles = mb // cfg.row_tile
    per_row_tile = counts.shape[0] * row_tiles <= MAX_PREFETCHED_COUNTS
    losses, hidden_grads, carried = [], [], None
    for block in range(count):
        ps = _Pass(b is not None, with_loss, with_grads, carried is not None, mb, per,
                   per_row_tile)
        block_counts = counts[:, block * row_tiles : (block + 1) * row_tiles]
        block_counts = block_counts.reshape(-1) if per_row_tile else block_counts.max(axis=1)
        loss, dh, dt, db = _pass(hp, t, b, idsp, gp, block_counts, carried, block, ps, cfg)
        losses.append(loss)
        hidden_grads.append(dh)
        if with_grads:
            carried = (dt,) + (() if b is None else (db,))
    num_rows = h.shape[0]
    loss = jnp.concatenate(losses)[:num_rows] if with_loss else None
    if not with_grads:
        return loss, None
    if cfg.dv_view:
        dh = jnp.concatenate(hidden_grads, axis=1).T[:num_rows]
    else:
        dh = jnp.concatenate(hidden_grads, axis=0)[:num_rows]
    grad_b = None if b is None else carried[1][0]
    return loss, (dh, _table_view(carried[0], cfg), grad_b)


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
    return _passes(h, t, b, ids, None, cfg, with_loss=True)[0] / cfg.vocab_size


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cut_bce(cfg, h, t, b, ids):
    return _per_row_loss(cfg, h, t, b, ids)


def _cut_bce_fwd(cfg, h, t, b, ids):
    return _per_row_loss(cfg, h, t, b, ids), (h, t, b, ids)


def _cut_bce_bwd(cfg, residuals, g):
    h, t, b, ids = residuals
    gv = g.astype(jnp.float32) / cfg.vocab_size
    _, grads = _passes(h, t, b, ids, gv, cfg, with_loss=False)
    return _grads_out(h, t, b, ids, grads)


_cut_bce.defvjp(_cut_bce_fwd, _cut_bce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_sum(cfg, h, t, b, ids, w):
    # Plain evaluation (no gradient asked): the loss alone.
    return jnp.vdot(w, _per_row_loss(cfg, h, t, b, ids))


def _weighted_sum_fwd(cfg, h, t, b, ids, w):
    sums, grads = _passes(h, t, b, ids, w / cfg.vocab_size, cfg, with_loss=True)
    return jnp.vdot(w, sums / cfg.vocab_size), (grads, h, t, b, ids, jnp.zeros_like(w))


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
        cores=int(tensorcores()),
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
    gradient is asked for, one Pallas pass per resident row block (one in
    all when the rows fit VMEM) goes over the logits once, computing the
    loss and the gradients of `hidden`, `table` and `bias` at cotangent 1;
    the backward pass only scales them. Plain evaluation runs the forward kernel alone.

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
