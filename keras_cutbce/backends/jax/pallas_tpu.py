"""CutBCE as Pallas TPU (Mosaic) kernels, forward and backward, under `jax.custom_vjp`.

The loss of a row is `(1 / V) * (dense + sparse)`:

- `dense = sum_v neg_scale * softplus(z_v) - neg_target * z_v` over the whole
  vocabulary, computed by Pallas kernels over a grid of (row tiles, vocabulary
  tiles). A `[tm, tv]` logits tile exists only in VMEM; float32 accumulators
  live in VMEM scratch.
- `sparse = sum_{v in P} delta_scale * softplus(z_v) - delta_target * z_v` over
  the row's valid, de-duplicated positives `P`: a gather of `L` table rows per
  position, in plain JAX (small).

The coefficients come from `keras_cutbce.coefficients.bce_coefficients`.
One `exp` and one `log1p` per logit (`e = exp(-|z|)`, `softplus(z) =
max(z, 0) + log1p(e)`, `sigmoid(z) = 1 / (1 + e)` or `e / (1 + e)`), all in
float32, so the loss and its gradients stay finite for any `|z|`.

Kernels (all recompute the logits `z = h @ E.T + b`; matmuls run in the input
dtype with float32 accumulation, `Precision.HIGHEST` for float32 inputs):

1. forward, grid `(rows, vocab)`: the per-row dense sum, accumulated over the
   vocabulary axis (`"arbitrary"`); padded vocabulary columns are masked with
   the true `V`.
2. `grad_hidden`, grid `(rows, vocab)`: `sum_v dz[m, v] E_v` accumulated over
   vocabulary tiles, `dz = g_m (neg_scale * sigmoid(z) - neg_target)`.
3. `grad_table` and `grad_bias`, grid `(vocab, rows)` (transposed):
   `sum_m dz[m, v] h_m` and `sum_m dz[m, v]` accumulated over row tiles.
   Padded rows have a zero cotangent, so they add nothing.

The sparse correction's gradients are added in float32 in the backward pass
and every gradient is cast once to its input's dtype.

Layout: per-row vectors (the forward output, the cotangent) travel
lane-broadcast as `[rows, 128]` float32 arrays, the bias as a `[1, V]`
float32 row; blocks are `(tm, D)`, `(tv, D)`, `(1, tv)` and `(tm, 128)`.

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

from keras_cutbce.coefficients import bce_coefficients

LANES = 128
MAX_ROW_TILE = 512
MIN_ROW_TILE = 128
MAX_VOCAB_TILE = 4096
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2**20
DEFAULT_VMEM_BUDGET_BYTES = DEFAULT_SCOPED_VMEM_BYTES * 3 // 4

# `x @ y.T` without materialising the transpose ("NT" matmul).
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def _round_up(value, multiple):
    return -(-int(value) // multiple) * multiple


def _on_tpu():
    try:
        return jax.devices()[0].platform == "tpu"
    except RuntimeError:
        return False


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
    neg_scale: float
    neg_target: float
    delta_scale: float
    delta_target: float
    row_tile: int
    vocab_tile: int
    interpret: bool


# ----------------------------------------------------------------------------
# In-kernel math: the one fused tile function and the per-logit terms.
# ----------------------------------------------------------------------------


def _tile_logits(h, t, b_ref):
    """Float32 logits `[tm, tv]` of a row tile `h` against a vocabulary tile `t`."""
    precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
    z = lax.dot_general(h, t, _NT, precision=precision, preferred_element_type=jnp.float32)
    if b_ref is not None:
        z = z + b_ref[...]
    return z


def _softplus_term(z, scale, target):
    """`scale * softplus(z) - target * z` with one exp and one log1p."""
    softplus = jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))
    term = softplus if scale == 1.0 else scale * softplus
    return term if target == 0.0 else term - target * z


def _sigmoid_grad(z, scale, target):
    """`scale * sigmoid(z) - target` with one exp."""
    e = jnp.exp(-jnp.abs(z))
    inv = 1.0 / (1.0 + e)
    sigmoid = jnp.where(z >= 0, inv, e * inv)
    grad = sigmoid if scale == 1.0 else scale * sigmoid
    return grad if target == 0.0 else grad - target


def _column_mask(shape, tile_index, cfg):
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + tile_index * cfg.vocab_tile
    return cols < cfg.vocab_size


def _needs_mask(cfg):
    return cfg.vocab_size % cfg.vocab_tile != 0


def _unpack(refs, has_bias, has_cotangent):
    """Splits kernel refs into `(h, t, bias | None, g | None, outputs_and_scratch)`."""
    refs = list(refs)
    h_ref, t_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    g_ref = refs.pop(0) if has_cotangent else None
    return h_ref, t_ref, b_ref, g_ref, refs


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _forward_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, b_ref, _, (out_ref, acc_ref) = _unpack(refs, has_bias, False)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    z = _tile_logits(h_ref[...], t_ref[...], b_ref)
    term = _softplus_term(z, cfg.neg_scale, cfg.neg_target)
    if _needs_mask(cfg):
        term = jnp.where(_column_mask(term.shape, j, cfg), term, 0.0)
    acc_ref[...] += jnp.sum(term, axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        out_ref[...] = acc_ref[...]


def _grad_hidden_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, b_ref, g_ref, (out_ref, acc_ref) = _unpack(refs, has_bias, True)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    t = t_ref[...]
    z = _tile_logits(h_ref[...], t, b_ref)
    dz = g_ref[:, :1] * _sigmoid_grad(z, cfg.neg_scale, cfg.neg_target)
    if _needs_mask(cfg):  # Padded table rows are zero; the mask makes it explicit.
        dz = jnp.where(_column_mask(dz.shape, j, cfg), dz, 0.0)
    precision = lax.Precision.HIGHEST if t.dtype == jnp.float32 else None
    acc_ref[...] += lax.dot_general(
        dz.astype(t.dtype), t, _NN, precision=precision, preferred_element_type=jnp.float32
    )

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        out_ref[...] = acc_ref[...]


def _grad_table_kernel(*refs, cfg, has_bias):
    h_ref, t_ref, b_ref, g_ref, outs = _unpack(refs, has_bias, True)
    if has_bias:
        dt_ref, db_ref, acc_t_ref, acc_b_ref = outs
    else:
        (dt_ref, acc_t_ref), db_ref, acc_b_ref = outs, None, None
    i = pl.program_id(1)  # Row tile: the reduction axis of this transposed grid.

    @pl.when(i == 0)
    def _init():
        acc_t_ref[...] = jnp.zeros_like(acc_t_ref)
        if has_bias:
            acc_b_ref[...] = jnp.zeros_like(acc_b_ref)

    h = h_ref[...]
    z = _tile_logits(h, t_ref[...], b_ref)
    # Padded rows carry a zero cotangent, so they add nothing.
    dz = g_ref[:, :1] * _sigmoid_grad(z, cfg.neg_scale, cfg.neg_target)
    precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
    acc_t_ref[...] += lax.dot_general(
        dz.T.astype(h.dtype), h, _NN, precision=precision, preferred_element_type=jnp.float32
    )
    if has_bias:
        acc_b_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dt_ref[...] = acc_t_ref[...]
        if has_bias:
            db_ref[...] = acc_b_ref[...]


# ----------------------------------------------------------------------------
# pallas_call wrappers on padded inputs.
# ----------------------------------------------------------------------------


def _pad_rows(x, rows):
    extra = rows - x.shape[0]
    return x if extra == 0 else jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _padded_inputs(h, t, b, cfg):
    mp = _round_up(h.shape[0], cfg.row_tile)
    vp = _round_up(t.shape[0], cfg.vocab_tile)
    hp, tp = _pad_rows(h, mp), _pad_rows(t, vp)
    bp = None if b is None else _pad_rows(b.astype(jnp.float32), vp).reshape(1, vp)
    return hp, tp, bp


def _row_major_specs(cfg, d, has_bias):
    """BlockSpecs of (h, t[, b]) for a grid (row tile i, vocab tile j)."""
    tm, tv = cfg.row_tile, cfg.vocab_tile
    specs = [
        pl.BlockSpec((tm, d), lambda i, j: (i, 0)),
        pl.BlockSpec((tv, d), lambda i, j: (j, 0)),
    ]
    if has_bias:
        specs.append(pl.BlockSpec((1, tv), lambda i, j: (0, j)))
    return specs


def _dense_forward(h, t, b, cfg):
    """Per-row dense sums `[M]` float32 (kernel 1)."""
    hp, tp, bp = _padded_inputs(h, t, b, cfg)
    mp, d = hp.shape
    tm, has_bias = cfg.row_tile, b is not None
    grid = (mp // tm, tp.shape[0] // cfg.vocab_tile)
    out = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg, has_bias=has_bias),
        grid=grid,
        in_specs=_row_major_specs(cfg, d, has_bias),
        out_specs=pl.BlockSpec((tm, LANES), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((mp, LANES), jnp.float32),
        scratch_shapes=[pltpu.VMEM((tm, LANES), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary"), cfg.interpret),
        interpret=_interpret_arg(cfg.interpret),
        name="cutbce_forward",
    )(*([hp, tp] + ([bp] if has_bias else [])))
    return out[: h.shape[0], 0]


def _dense_backward(h, t, b, g, cfg):
    """Float32 `(grad_hidden [M, D], grad_table [V, D], grad_bias [V] | None)` (kernels 2, 3)."""
    hp, tp, bp = _padded_inputs(h, t, b, cfg)
    (mp, d), vp = hp.shape, tp.shape[0]
    tm, tv, has_bias = cfg.row_tile, cfg.vocab_tile, b is not None
    gp = jnp.broadcast_to(_pad_rows(g.astype(jnp.float32), mp)[:, None], (mp, LANES))
    inputs = [hp, tp] + ([bp] if has_bias else []) + [gp]
    interpret = _interpret_arg(cfg.interpret)

    grad_h = pl.pallas_call(
        functools.partial(_grad_hidden_kernel, cfg=cfg, has_bias=has_bias),
        grid=(mp // tm, vp // tv),
        in_specs=_row_major_specs(cfg, d, has_bias)
        + [pl.BlockSpec((tm, LANES), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((tm, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((mp, d), jnp.float32),
        scratch_shapes=[pltpu.VMEM((tm, d), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary"), cfg.interpret),
        interpret=interpret,
        name="cutbce_grad_hidden",
    )(*inputs)

    # Transposed grid (vocab tile j, row tile i): the table gradient is
    # accumulated over row tiles while its block stays in VMEM.
    in_specs = [
        pl.BlockSpec((tm, d), lambda j, i: (i, 0)),
        pl.BlockSpec((tv, d), lambda j, i: (j, 0)),
    ]
    if has_bias:
        in_specs.append(pl.BlockSpec((1, tv), lambda j, i: (0, j)))
    in_specs.append(pl.BlockSpec((tm, LANES), lambda j, i: (i, 0)))
    out_specs = [pl.BlockSpec((tv, d), lambda j, i: (j, 0))]
    out_shape = [jax.ShapeDtypeStruct((vp, d), jnp.float32)]
    scratch = [pltpu.VMEM((tv, d), jnp.float32)]
    if has_bias:
        out_specs.append(pl.BlockSpec((1, tv), lambda j, i: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((1, vp), jnp.float32))
        scratch.append(pltpu.VMEM((1, tv), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_grad_table_kernel, cfg=cfg, has_bias=has_bias),
        grid=(vp // tv, mp // tm),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=_compiler_params(("parallel", "arbitrary"), cfg.interpret),
        interpret=interpret,
        name="cutbce_grad_table",
    )(*inputs)
    vocab = t.shape[0]
    grad_t = outs[0][:vocab]
    grad_b = outs[1][0, :vocab] if has_bias else None
    return grad_h[: h.shape[0]], grad_t, grad_b


# ----------------------------------------------------------------------------
# Sparse correction over the positives (plain JAX).
# ----------------------------------------------------------------------------


def _positives(ids, vocab_size):
    """Sorted safe ids `[M, L]` and a mask of valid first occurrences."""
    ids = ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < vocab_size)
    # Invalid ids become -1 and sort first; duplicates become neighbours.
    ids = jnp.sort(jnp.where(valid, ids, -1), axis=1)
    first = jnp.concatenate(
        [jnp.ones_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=1
    )
    keep = first & (ids >= 0)
    return jnp.where(keep, ids, 0), keep


def _positive_logits(h, t, b, safe):
    """Float32 logits `[M, L]` of each row at its (safe) positive ids."""
    rows = t[safe]  # [M, L, D]
    precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
    z = jnp.einsum("md,mld->ml", h, rows, precision=precision,
                   preferred_element_type=jnp.float32)
    if b is not None:
        z = z + b.astype(jnp.float32)[safe]
    return z, rows


def _sparse_forward(h, t, b, safe, keep, cfg):
    z, _ = _positive_logits(h, t, b, safe)
    if cfg.delta_scale == 0.0:
        term = -cfg.delta_target * z
    else:
        term = cfg.delta_scale * jax.nn.softplus(z) - cfg.delta_target * z
    return jnp.sum(jnp.where(keep, term, 0.0), axis=1)


def _sparse_backward(h, t, b, safe, keep, gv, cfg):
    """Float32 gradients of `sum_m gv_m * sparse_m` for h, t, b."""
    z, rows = _positive_logits(h, t, b, safe)
    dz = -cfg.delta_target * jnp.ones_like(z)
    if cfg.delta_scale != 0.0:
        dz = dz + cfg.delta_scale * jax.nn.sigmoid(z)
    dz = jnp.where(keep, dz * gv[:, None], 0.0)  # [M, L]
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


# ----------------------------------------------------------------------------
# custom_vjp.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cut_bce(cfg, h, t, b, ids):
    loss, _ = _cut_bce_fwd(cfg, h, t, b, ids)
    return loss


def _cut_bce_fwd(cfg, h, t, b, ids):
    safe, keep = _positives(ids, cfg.vocab_size)
    dense = _dense_forward(h, t, b, cfg)
    sparse = _sparse_forward(h, t, b, safe, keep, cfg)
    loss = (dense + sparse) / cfg.vocab_size
    return loss, (h, t, b, ids, safe, keep)


def _cut_bce_bwd(cfg, residuals, g):
    h, t, b, ids, safe, keep = residuals
    gv = g.astype(jnp.float32) / cfg.vocab_size
    dh, dt, db = _dense_backward(h, t, b, gv, cfg)
    sh, st, sb = _sparse_backward(h, t, b, safe, keep, gv, cfg)
    grad_b = None if b is None else (db + sb).astype(b.dtype)
    grad_ids = None
    if jnp.issubdtype(ids.dtype, jnp.integer):  # Integer primals take float0 cotangents.
        grad_ids = np.zeros(ids.shape, dtype=jax.dtypes.float0)
    return (dh + sh).astype(h.dtype), (dt + st).astype(t.dtype), grad_b, grad_ids


_cut_bce.defvjp(_cut_bce_fwd, _cut_bce_bwd)


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
        ids: integer `[M, L]`; ids outside `[0, V)` are padding, duplicates count once.
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
    hidden = jnp.asarray(hidden)
    table = jnp.asarray(table)
    ids = jnp.asarray(ids)
    bias = None if bias is None else jnp.asarray(bias)
    # Mixed dtypes (e.g. bfloat16 activations on a float32 table under Keras
    # mixed precision): the kernels see one promoted dtype; autodiff casts the
    # gradients back to each input's dtype.
    compute_dtype = jnp.result_type(hidden.dtype, table.dtype)
    hidden, table = hidden.astype(compute_dtype), table.astype(compute_dtype)
    num_rows, dim = hidden.shape
    vocab_size = table.shape[0]
    if ids.ndim == 1:
        ids = ids[:, None]
    tm, tv = choose_tiles(num_rows, vocab_size, dim, hidden.dtype)
    if chunk_size is not None:
        tv = min(_round_up(chunk_size, LANES), _round_up(vocab_size, LANES))
    if block_rows is not None:
        tm = min(_round_up(block_rows, LANES), _round_up(max(num_rows, 1), LANES))
    if interpret is None:
        interpret = not _on_tpu()
    coef = bce_coefficients(label_smoothing, pos_weight)
    cfg = _Config(
        vocab_size=int(vocab_size),
        neg_scale=float(coef.neg_scale),
        neg_target=float(coef.neg_target),
        delta_scale=float(coef.delta_scale),
        delta_target=float(coef.delta_target),
        row_tile=int(tm),
        vocab_tile=int(tv),
        interpret=bool(interpret),
    )
    if ids.shape[1] == 0:  # No positives: one padding id keeps shapes non-empty.
        ids = jnp.full((num_rows, 1), -1, jnp.int32)
    if num_rows == 0:
        return jnp.zeros((0,), jnp.float32)
    return _cut_bce(cfg, hidden, table, bias, ids)
