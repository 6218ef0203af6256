"""The Pallas TPU kernel: one pass over the table for a block of resident rows, given a loss family.

Grid `(core, vocabulary tile, row tile)`; the step's tile runs in
register-sized pieces, software-pipelined between the MXU and the VPU. The
loop owns the tiles, the matmuls, the gradients and the hit bits (each row's
ids in the tile); a family (`BCE`, `Softmax`) owns what the loss decides: its
per-logit terms and slopes (`tile`), the lanes' and rows' reductions (`init`,
`merge`) and the refs they need. The design: docs/tpu.md.
"""

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from keras_cutbce.backends.jax import math as jax_math
from keras_cutbce.common import EMPTY_ID, round_up

LANES = 128
PIECE_COLS = 512  # the widest piece of a step's tile (a family's `piece_cols`: softmax's; BCE's 256)

# -- BCE's per-logit loss and slope (the spec table checks them) --------------------
#
# A positive flips its logit's sign by one xor; one `exp`, `log` and
# reciprocal a logit, `log1p(e) = log(u) + (e - (u - 1))` with `u = 1 + e`.
# In base 2 the logits come scaled by `log2(e)` (`LOG2E`, folded into the
# hidden states before the matmul): `exp2` needs no scaling, and the relu
# parts are summed apart, `LN2` applied to their row sums (`term`).

SIGN_BIT = -(2**31)  # int32 with only the sign bit set
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def flip(z, hits):
    """Returns `z` with the sign flipped where `hits` (int32) has its sign bit."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(z, jnp.int32) ^ hits, z.dtype)


def _weights(coef):
    """Returns `((A_neg, A_pos), (B_neg, B_pos))` (the section's comment)."""
    (neg_minus, neg_plus), (pos_minus, pos_plus) = coef.negative_weights, coef.positive_weights
    return (neg_plus, pos_minus), (neg_minus, pos_plus)


def _is(weight, value):
    """Whether a weight is statically `value` (a Python float, not a per-logit array)."""
    return isinstance(weight, float) and weight == value


def _per_logit(pair, positive):
    neg, pos = pair
    return neg if neg == pos else jnp.where(positive, pos, neg)


class Exps:
    """`e = exp(-|f|)`, `u = 1 + e` and `r = 1 / u`; `barrier` keeps XLA from folding `(1 + e) - 1`.

    `base2`: `f` is the logit times `LOG2E`. `newton`: `r` as the approximate
    reciprocal and one Newton step, the float32 division libtpu compiles for
    v4, v5e and v5p without its branches for infinite, zero and huge
    divisors (`u` is in [1, 2]); in a kernel only.
    """

    def __init__(self, f, barrier=False, base2=False, newton=False):
        negative_abs = lax.bitcast_convert_type(  # -|f|: one or (the sign bit set)
            lax.bitcast_convert_type(f, jnp.int32) | SIGN_BIT, f.dtype)
        # `pow(2, x)`: Mosaic lowers it to exp2 (one transcendental op), and the
        # CPU (the interpreter) computes it exactly where its `exp2` is `exp(x ln 2)`.
        # The base a literal of `f`'s dtype (a Python 2.0 is float64 under x64).
        self.e = lax.pow(f.dtype.type(2.0), negative_abs) if base2 else jnp.exp(negative_abs)
        self.u = 1.0 + self.e
        if barrier:
            self.u = lax.optimization_barrier(self.u)
        if newton:
            r = pl.reciprocal(self.u, approx=True)
            self.r = r + r * (1.0 - r * self.u)
        else:
            self.r = 1.0 / self.u


def term(f, ex, coef, positive):
    """Returns `(relus, logs)`: each logit's loss term `A softplus(f) + B softplus(-f)` in two parts.

    `f`: `flip`ped logits. The term is `relus + logs`, or in base 2 (`f`
    times `LOG2E`, `relus` then in base-2 units) `relus * LN2 + logs`.
    """
    a, b = (_per_logit(w, positive) for w in _weights(coef))
    # log1p(e) = log(u) + the rounding error of u = 1 + e (u - 1 is exact).
    log1p_e = jnp.log(ex.u) + (ex.e - (ex.u - 1.0))
    relu = jnp.maximum(f, 0.0)
    out = relu if _is(a, 1.0) else a * relu
    if not _is(b, 0.0):
        out = out + b * jnp.maximum(-f, 0.0)
    ab = a + b
    return out, (log1p_e if _is(ab, 1.0) else ab * log1p_e)


def slope(f, ex, coef, positive):
    """Returns `d loss / d f` per logit (xor `hits` gives `d loss / d z`)."""
    a, b = (_per_logit(w, positive) for w in _weights(coef))
    nonneg = f >= 0
    sig = jnp.where(nonneg, 1.0, ex.e) * ex.r  # sigmoid(f)
    out = sig if _is(a, 1.0) else a * sig
    if not _is(b, 0.0):
        out = out - b * (jnp.where(nonneg, ex.e, 1.0) * ex.r)  # sigmoid(-f)
    return out


def needs_mask(coef):
    """Whether the weights differ between negatives and positives (a per-logit select)."""
    return any(neg != pos for neg, pos in _weights(coef))


def term_and_slope(z, positive, coef, base2=False):
    """Returns the loss term and `d loss / d z` of logits `z` (for tests; float32).

    `base2`: of the logits `z * LOG2E` rounded to float32, as the kernel gets them.
    """
    positive = jnp.broadcast_to(jnp.asarray(positive), z.shape)
    hits = jnp.where(positive, SIGN_BIT, 0).astype(jnp.int32)
    f = flip(jnp.float32(LOG2E) * z if base2 else z, hits)
    ex = Exps(f, barrier=True, base2=base2)
    mask = positive if needs_mask(coef) else None
    relus, logs = term(f, ex, coef, mask)
    return (relus * LN2 if base2 else relus) + logs, flip(slope(f, ex, coef, mask), hits)


# -- Lanes and hit bits: what the families read and write ---------------------------

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


def _hits(bits, block):
    """Returns the sign bit where bit `block` of `bits` is set, else 0 (`flip`)."""
    return jnp.left_shift(bits, 31 - block) & SIGN_BIT


def _hit_mask(bits, block):
    """Returns all ones where bit `block` of `bits` is set, else 0 (an and-mask for `_masked`)."""
    return lax.shift_right_arithmetic(jnp.left_shift(bits, 31 - block), 31)


def _masked(x, mask):
    """Returns float32 `x` where `mask` (int32, `_hit_mask`) is all ones, else 0."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) & mask, jnp.float32)


def _lanes(x, width):
    """Returns `[n, 128]` repeated to `[n, width]` along the lanes (the same vregs)."""
    return x if width == LANES else jnp.concatenate([x] * (width // LANES), axis=1)


def _fold(x, op=jnp.add):
    """Returns `[n, k 128]` reduced to `[n, 128]` by `op` over lane blocks (no cross-lane work)."""
    out = x[:, :LANES]
    for k in range(1, x.shape[1] // LANES):
        out = op(out, x[:, k * LANES:(k + 1) * LANES])
    return out


# Softmax's running max starts here, not at `-inf`: `exp(LOWEST - LOWEST)` is 1 times a zero
# sum, where `exp(-inf - -inf)` is NaN; a logit of `-inf` still adds exactly 0.
LOWEST = float(jnp.finfo(jnp.float32).min)


def _rescaled(total, m_old, m_new):
    """`total * exp(m_old - m_new)`: a sum of `exp(z - m_old)` moved to the max `m_new`."""
    return total * jnp.exp(m_old - m_new)


# -- The loss families in the kernel --------------------------------------------------
#
# Static (hashable) parts of `api.Config`, one method set (docs/development.md,
# "Pallas"): the refs a pass needs (`init`, `lanes`, `slope_inputs`), a piece's
# terms and slopes (`hits`, `tile`), the reductions (`merge`, `merge_cores`),
# `logit_sums` (the rows' `sum_v z_v` added outside, in closed form), and `xla`,
# the backend family run around the kernel. A new family is one class here.


class BCE(NamedTuple):
    """Binary cross-entropy: a positive flips its logit's sign, the rows sum their terms."""

    coef: object  # `keras_cutbce.math.coefficients.BCECoefficients`

    two_pass = False
    logit_sums = False  # the tiles hold the whole background
    piece_cols = 256  # libtpu packs BCE's schedule tighter (docs/tpu.md)
    hits = staticmethod(_hits)

    @property
    def xla(self):
        return jax_math.BCE(self.coef)

    def kernel_name(self, ps):
        if ps.with_loss:
            return "cutbce_fused" if ps.with_grads else "cutbce_forward"
        return "cutbce_grads"

    def finds_positives(self, ps):
        return True

    def in_base2(self, cfg):
        """Whether the logits come in base 2 (`LOG2E` folded into the hidden states).

        Float32 matmuls in the `[D, V]` view, whose hidden states are copied
        anyway: a 16-bit copy scaled by `LOG2E` would change the products.
        """
        return cfg.dv_view and jnp.dtype(cfg.mm_dtype) == jnp.float32

    def init(self, ps):
        return (("loss", 0.0),) if ps.with_loss else ()

    def lanes(self, cfg, ps):
        if not ps.with_loss:
            return ()
        return (("lane_terms", 0.0),) + ((("lane_relus", 0.0),) if self.in_base2(cfg) else ())

    def slope_inputs(self, ps):
        return ()

    def tile(self, z, hits, valid, local, refs, cfg, ps, interpreted):
        """Adds a piece's terms to the lanes; returns its slopes `d loss / d z`, or None."""
        f = flip(z, hits)
        ex = Exps(f, barrier=interpreted, base2=self.in_base2(cfg), newton=cfg.newton_reciprocal)
        positive = hits != 0 if needs_mask(self.coef) else None
        if ps.with_loss:
            relus, logs = term(f, ex, self.coef, positive)
            if "lane_relus" in refs:  # base 2: the relu parts apart (`term`)
                parts = ((refs["lane_relus"], relus), (refs["lane_terms"], logs))
            else:
                parts = ((refs["lane_terms"], relus + logs),)
            for ref, x in parts:
                ref[local, :] += _fold(x if valid is None else jnp.where(valid, x, 0.0))
        if not ps.with_grads:
            return None
        dz = flip(slope(f, ex, self.coef, positive), hits)
        return dz if valid is None else jnp.where(valid, dz, 0.0)

    def merge(self, refs, rows):
        if "loss" not in refs:
            return
        terms = refs["lane_terms"][...]
        if "lane_relus" in refs:
            terms = refs["lane_relus"][...] * LN2 + terms
        refs["loss"][:, rows] += _as_row(jnp.sum(terms, axis=1, keepdims=True))

    def merge_cores(self, outs, ps):
        return tuple(x.sum(axis=0)[0] for x in outs)


class Softmax(NamedTuple):
    """Softmax cross-entropy: the rows' running (max, sum exp), slopes `exp(z - lse) - a / V`."""

    label_smoothing: float
    vocab: int
    positives: bool = True  # the kernels find the rows' ids (hit bits); False: no ids

    two_pass = True  # a statistics pass gives `lse`, the gradient pass takes it
    piece_cols = PIECE_COLS  # the statistics rescale their sums once a piece
    hits = staticmethod(_hit_mask)

    @property
    def logit_sums(self):
        """Whether the loss needs the rows' `sum_v z_v` (smoothing's `a / V`), summed outside."""
        return bool(self.label_smoothing)

    @property
    def xla(self):
        return jax_math.Softmax(self.label_smoothing, self.vocab)

    def kernel_name(self, ps):
        return "cutsoftmax_grads" if ps.with_grads else "cutsoftmax_stats"

    def finds_positives(self, ps):
        """Ids in the tiles: the positives' slopes, or their logits' sums (`positive_sums`)."""
        return self.positives and (ps.with_grads or ps.positive_sums)

    def in_base2(self, cfg):
        return False

    def init(self, ps):
        rows = (("max", LOWEST), ("sum_exp", 0.0)) if ps.with_loss else ()
        return rows + ((("positive", 0.0),) if ps.positive_sums else ())

    def lanes(self, cfg, ps):
        lanes = (("lane_max", LOWEST), ("lane_sum_exp", 0.0)) if ps.with_loss else ()
        return lanes + ((("lane_positive", 0.0),) if ps.positive_sums else ())

    def slope_inputs(self, ps):
        """`lse` (padded rows: `+inf`, slopes 0) and the positives' slope `weight`."""
        if not ps.with_grads:
            return ()
        return (("lse", jnp.inf),) + ((("weight", 0.0),) if self.positives else ())

    def tile(self, z, hits, valid, local, refs, cfg, ps, interpreted):
        """Adds a piece to the lanes' running (max, sum exp, sum z_p); returns its slopes or None.

        The slopes: `exp(z - lse) - a / V`, plus the row's weight at its positives
        (`hits`: `_hit_mask`).
        """
        if "lane_positive" in refs:
            refs["lane_positive"][local, :] += _fold(_masked(z, hits))
        if ps.with_loss:
            zm = z if valid is None else jnp.where(valid, z, LOWEST)
            m_old = refs["lane_max"][local, :]
            m_new = jnp.maximum(m_old, _fold(zm, jnp.maximum))
            refs["lane_max"][local, :] = m_new
            refs["lane_sum_exp"][local, :] = (
                _rescaled(refs["lane_sum_exp"][local, :], m_old, m_new)
                + _fold(jnp.exp(zm - _lanes(m_new, z.shape[1]))))
        if not ps.with_grads:
            return None
        dz = jnp.exp(z - _lanes(refs["lse_col"][local, :], z.shape[1]))
        if self.label_smoothing:
            dz = dz - self.label_smoothing / self.vocab
        if hits is not None:
            dz = dz + _masked(_lanes(refs["weight_col"][local, :], z.shape[1]), hits)
        return dz if valid is None else jnp.where(valid, dz, 0.0)

    def merge(self, refs, rows):
        """The step's (max, sum exp) merged into the rows'; the positives' sums added."""
        if "max" in refs:
            m_lanes = refs["lane_max"][...]
            m_step = jnp.max(m_lanes, axis=1, keepdims=True)
            s_step = _as_row(jnp.sum(_rescaled(refs["lane_sum_exp"][...], m_lanes, m_step),
                                     axis=1, keepdims=True))
            m_step = _as_row(m_step)
            m_old = refs["max"][:, rows]
            m_new = jnp.maximum(m_old, m_step)
            refs["sum_exp"][:, rows] = (_rescaled(refs["sum_exp"][:, rows], m_old, m_new)
                                        + _rescaled(s_step, m_step, m_new))
            refs["max"][:, rows] = m_new
        if "positive" in refs:
            refs["positive"][:, rows] += _as_row(jnp.sum(refs["lane_positive"][...], axis=1,
                                                         keepdims=True))

    def merge_cores(self, outs, ps):
        """The rows' `(max, sum exp)` of the cores' `[cores, 1, rows]` partials, then the positives' sums."""
        stats = ()
        if ps.with_loss:
            maxes, sums = outs[0][:, 0], outs[1][:, 0]
            m = jnp.max(maxes, axis=0)
            stats = (m, jnp.sum(sums * jnp.exp(maxes - m), axis=0))
        return stats + ((outs[-1].sum(axis=0)[0],) if ps.positive_sums else ())


# -- The kernel ------------------------------------------------------------

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


def _table_piece(table_ref, cols, cfg, edge, item):
    """Returns the table's `cols` (`[D, n]` or `[n, D]`), items at or past V zeroed on the edge."""
    table = table_ref[:, cols] if cfg.dv_view else table_ref[cols, :]
    if edge:
        items = lax.broadcasted_iota(jnp.int32, table.shape, 1 if cfg.dv_view else 0) + item
        table = jnp.where(items < cfg.vocab_size, table, jnp.zeros_like(table))
    return table


BIAS_PARTS = 3  # bfloat16 parts that sum to a float32 exactly: the MXU's pass precision drops none


def _parts(x, rows):
    """Returns `[1, n]` float32 `x` as `[rows, n]`: its `BIAS_PARTS` bfloat16-exact parts, then zeros."""
    rest = jnp.broadcast_to(x, (rows, x.shape[1]))
    row = lax.broadcasted_iota(jnp.int32, rest.shape, 0)
    out = jnp.zeros_like(rest)
    for k in range(BIAS_PARTS):
        part = rest.astype(jnp.bfloat16).astype(jnp.float32)
        out = jnp.where(row == k, part, out)
        rest = jnp.where(jnp.abs(part) < jnp.inf, rest - part, 0.0)  # -inf: one part, no NaN
    return out


def _logits(hidden, table, bias, cfg):
    """Returns the float32 logits `[rows, n]` of `[rows, D]` hidden states: `hidden @ table(.T)`."""
    z = _matmul(hidden, table, _NN if cfg.dv_view else _NT, cfg)
    return z if bias is None else z + bias


def _grad_hidden_tile(dz, table, cfg):
    """Returns a tile's hidden gradient in the rows' layout: `table @ dz.T` or `dz @ table`."""
    return _matmul(table, dz, _NT, cfg) if cfg.dv_view else _matmul(dz, table, _NN, cfg)


def _grad_table_tile(hidden, dz, cfg):
    """Returns a tile's table gradient in the table view's layout: `hidden @ dz` or `dz.T @ h`."""
    return _matmul(hidden, dz, _NN, cfg) if cfg.dv_view else _matmul(dz, hidden, _TN, cfg)


def _first_slots(ids, lo):
    """Returns `[1, n]`: how many of each row's sorted ids lie below the tile's first item `lo`."""
    return jnp.sum((ids < lo).astype(jnp.int32), axis=0, keepdims=True)


def _pick(ids, first, k):
    """Returns `[1, n]`: each row's id at slot `first + k` (its k-th id from the tile on), or -1."""
    slot = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return jnp.max(jnp.where(slot == first + k, ids, EMPTY_ID), axis=0, keepdims=True)


def _fill_hit_bits(bits_ref, bits_t_ref, ids, first, count, lo, tile):
    """Writes `bits_ref` `[rows, 128]`: bit `b` of lane `l` set where item `lo + 128 b + l` is an id."""
    lane = lax.broadcasted_iota(jnp.int32, bits_t_ref.shape, 0)
    bits_t_ref[...] = jnp.zeros(bits_t_ref.shape, jnp.int32)

    def add(k, carry):
        item = _pick(ids, first, k) - lo  # [1, rows]: past the tile, or -1 - lo
        inside = (item >= 0) & (item < tile)
        at = jnp.where(inside, item & (LANES - 1), -1)
        bit = jnp.left_shift(jnp.ones_like(item), jnp.where(inside, item >> 7, 0))
        bits_t_ref[...] = bits_t_ref[...] | jnp.where(lane == at, bit, 0)
        return carry

    lax.fori_loop(0, count, add, 0)
    bits_ref[...] = jnp.transpose(bits_t_ref[...])


def kernel(*refs, cfg, ps, names, interpreted=False):
    """Writes the family's row outputs and/or the gradients of one block of resident rows.

    `names`: the refs' names, in the order `api._pass` gives them;
    `interpreted`: traced for the interpreter (`Exps`).
    """
    family = cfg.family
    refs = dict(zip(names, refs))
    in_tile_ref, hidden_ref, table_ref = refs["in_tile"], refs["hidden"], refs["table"]
    ids_ref = refs.get("ids")
    row_scale_ref = refs.get("row_scale")
    bias_ref = refs.get("bias")
    carried_table, carried_bias = refs.get("carried_table"), refs.get("carried_bias")
    grad_hidden_ref, grad_table_ref = refs.get("grad_hidden"), refs.get("grad_table")
    # A float32 table gradient accumulates in its output block (resident
    # across the row tiles), another dtype in a float32 scratch.
    acc_table = refs.get("acc_table", grad_table_ref)
    acc_bias = refs.get("grad_bias")
    scaled_ref = refs.get("scaled")
    slopes_refs = (refs.get("slopes_0"), refs.get("slopes_1"))
    bits_ref, bits_t_ref = refs.get("bits"), refs.get("bits_t")
    scale_col_ref = refs.get("scale_col")
    hidden_t_ref = refs.get("hidden_t")
    bias_parts_ref = refs.get("bias_parts")
    logits_refs = (refs["logits_0"], refs["logits_1"])
    base2 = family.in_base2(cfg)
    extra = ps.bias_rows  # the bias on the MXU
    vpu_bias = ps.has_bias and not extra  # the bias added and its gradient summed on the VPU
    core, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile_index = core * ps.tiles_per_core + j
    row_tile = cfg.row_tile
    rows = pl.ds(pl.multiple_of(i * row_tile, row_tile), row_tile)
    piece_rows, piece_cols = cfg.piece

    def hidden_rows(ref):
        return ref.at[:, rows] if cfg.dv_view else ref.at[rows, :]

    def columns(c):
        return pl.ds(pl.multiple_of(c * piece_cols, piece_cols), piece_cols)

    def logits_column(c, buffer, edge, lo):
        """Writes piece column `c`'s logits `[row_tile, cols]` to `logits_refs[buffer]` (MXU)."""
        cols_ds = columns(c)
        table = _table_piece(table_ref, cols_ds, cfg, edge, lo + cols_ds.start)
        bias = bias_ref[:, cols_ds] if vpu_bias else None
        if extra:
            table = jnp.concatenate([table.astype(bias_parts_ref.dtype),
                                     bias_parts_ref[:, cols_ds]], axis=0)
        hidden = hidden_t_ref[...] if cfg.dv_view else hidden_rows(hidden_ref)[...]
        logits_refs[buffer][...] = _logits(hidden, table, bias, cfg)

    def elementwise(c, buffer, edge, lo, part):
        """Returns column `c`'s slopes of rows `part`, or None; the family adds their terms."""
        cols_ds = columns(c)
        c0 = cols_ds.start
        valid = None
        if edge:
            cols = lax.broadcasted_iota(jnp.int32, (piece_rows, piece_cols), 1) + (lo + c0)
            valid = cols < cfg.vocab_size
        slopes, bias_grad = [], None
        for r0 in range(part.start, part.stop, piece_rows):
            local = slice(r0, r0 + piece_rows)
            z = logits_refs[buffer][local, :]
            hits = None
            if ps.hit_bits:
                bits = bits_ref[local, :]
                hits = jnp.concatenate([family.hits(bits, c * piece_cols // LANES + k)
                                        for k in range(piece_cols // LANES)], axis=1)
            dz = family.tile(z, hits, valid, local, refs, cfg, ps, interpreted)
            if dz is None:
                continue
            slopes.append(dz.astype(jnp.dtype(cfg.mm_dtype)))
            if vpu_bias:
                weighted = _lanes(scale_col_ref[local, :], piece_cols) * dz
                grad = jnp.sum(weighted, axis=0, keepdims=True)
                bias_grad = grad if bias_grad is None else bias_grad + grad
        if bias_grad is not None:
            acc_bias[:, cols_ds] += bias_grad
        return jnp.concatenate(slopes, axis=0) if slopes else None

    def gradients(c, slopes_ref, edge, lo, part):
        """Adds piece column `c`'s slopes of rows `part` to the hidden and table gradients."""
        cols_ds = columns(c)
        table = _table_piece(table_ref, cols_ds, cfg, edge, lo + cols_ds.start)
        dz = slopes_ref[part, :]
        first = pl.multiple_of(rows.start + part.start, LANES if cfg.dv_view else 8)
        if cfg.dv_view:
            grad_hidden = grad_hidden_ref.at[:, pl.ds(first, dz.shape[0])]
            scaled = scaled_ref[:, part]
        else:
            grad_hidden = grad_hidden_ref.at[pl.ds(first, dz.shape[0]), :]
            scaled = scaled_ref[part, :]
        grad_hidden[...] += _grad_hidden_tile(dz, table, cfg)
        grad = _grad_table_tile(scaled, dz, cfg)
        if extra:  # the row scale's parts' rows: the bias gradient
            dim = acc_table.shape[0]
            acc_bias[:, cols_ds] += jnp.sum(grad[dim:], axis=0, keepdims=True)
            grad = grad[:dim]
        if cfg.dv_view:
            acc_table[:, cols_ds] += grad
        else:
            acc_table[cols_ds, :] += grad

    def pieces(edge, lo):
        """The step's tile, piece column by piece column (unrolled, double-buffered logits and slopes)."""
        count = cfg.tile // piece_cols
        whole = slice(0, row_tile)
        logits_column(0, 0, edge, lo)
        for c in range(count):
            buffer = c % 2
            aligned = row_tile % (2 * (LANES if cfg.dv_view else piece_rows)) == 0
            half = row_tile // 2 if c == count - 1 and aligned else row_tile
            for start in range(0, row_tile, half):
                part = slice(start, start + half)
                slopes = elementwise(c, buffer, edge, lo, part)
                if start == 0 and c + 1 < count:
                    logits_column(c + 1, 1 - buffer, edge, lo)
                if ps.with_grads:
                    if start == 0 and c > 0:
                        gradients(c - 1, slopes_refs[1 - buffer], edge, lo, whole)
                    slopes_refs[buffer][part, :] = slopes
                    if c == count - 1:
                        gradients(c, slopes_refs[buffer], edge, lo, part)

    def body(edge):
        @pl.when(j == 0)
        def _init_rows():  # this core's first visit of these rows
            for name, empty in family.init(ps):
                refs[name][:, rows] = jnp.full((1, row_tile), empty, jnp.float32)
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

        if extra:
            @pl.when(i == 0)
            def _bias_parts():  # the tile's bias as bfloat16-exact rows, once a vocabulary tile
                bias = bias_ref[...]
                if edge:
                    items = lax.broadcasted_iota(jnp.int32, bias.shape, 1) + tile_index * cfg.tile
                    bias = jnp.where(items < cfg.vocab_size, bias, 0.0)
                if base2:
                    bias = bias * LOG2E
                bias_parts_ref[...] = _parts(bias, extra).astype(bias_parts_ref.dtype)

        lo = tile_index * cfg.tile
        for name, empty in family.lanes(cfg, ps):
            refs[name][...] = jnp.full(refs[name].shape, empty, jnp.float32)
        for name, _ in family.slope_inputs(ps):
            column = refs[name + "_col"]
            column[...] = jnp.broadcast_to(_as_columns(refs[name][:, rows], 0.0), column.shape)
        if scale_col_ref is not None:
            scale_col_ref[...] = jnp.broadcast_to(
                _as_columns(row_scale_ref[:, rows], 0.0), scale_col_ref.shape)
        if ps.with_grads:
            # The slopes carry no row scale: it multiplies the hidden states
            # here (table gradient) and the hidden gradient in `api`.
            scale = row_scale_ref[:, rows] if cfg.dv_view else scale_col_ref[:, 0:1]
            hidden = hidden_rows(hidden_ref)[...].astype(jnp.float32)
            scaled = hidden * scale
            if extra:
                scaled = jnp.concatenate([scaled, _parts(scale, extra)], axis=0)
            scaled_ref[...] = scaled.astype(scaled_ref.dtype)
        if ps.hit_bits:
            ids = ids_ref[:, rows]
            first = _first_slots(ids, lo)
            count_index = (tile_index * pl.num_programs(2) + i if ps.counts_per_row_tile
                           else tile_index)
            _fill_hit_bits(bits_ref, bits_t_ref, ids, first, in_tile_ref[count_index], lo,
                           cfg.tile)
        if hidden_t_ref is not None:  # [D, rows] -> [rows, D]: row pieces on the sublanes
            hidden = hidden_rows(hidden_ref)[...].astype(jnp.float32)
            if base2:
                hidden = hidden * LOG2E
            if extra:  # ones against the bias parts' rows
                ones = lax.broadcasted_iota(jnp.int32, (extra, row_tile), 0) < BIAS_PARTS
                hidden = jnp.concatenate([hidden, ones.astype(jnp.float32)], axis=0)
            hidden_t_ref[...] = jnp.transpose(hidden).astype(hidden_t_ref.dtype)
        pieces(edge, lo)
        family.merge(refs, rows)
        if ps.with_grads and "acc_table" in refs:
            @pl.when(i == pl.num_programs(2) - 1)
            def _store():
                grad_table_ref[...] = acc_table[...].astype(grad_table_ref.dtype)

    # The edge masks run on the last tile of an unaligned V only; the last
    # core's steps past the last tile (their blocks clamped) do nothing.
    tiles = cfg.num_tiles
    if cfg.vocab_size % cfg.tile:
        pl.when(tile_index < tiles - 1)(lambda: body(False))
        pl.when(tile_index == tiles - 1)(lambda: body(True))
    elif ps.tiles_per_core * cfg.active_cores == tiles:
        body(False)
    else:
        pl.when(tile_index < tiles)(lambda: body(False))
