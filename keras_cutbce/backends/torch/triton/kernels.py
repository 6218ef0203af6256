"""The fused Triton kernels: the `[BLOCK_M, BLOCK_N]` logits `h . E_v + b_v` live only in registers.

`FAMILY` (compiled in): `"bce"` masks each row's positives to `-inf`; `"softmax"` keeps a running
`(max, sum exp(z - max))` per row. Design and precision rules: docs/cutbce.md, "CutBCE on CUDA".
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr, PRECISION: tl.constexpr):
    if INTERPRET:  # bf16 `tl.dot` is wrong in the interpreter (triton#11584); fp32 holds bf16 exactly
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _power_of_two(exponent_bits):
    return (exponent_bits << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rescaled(largest, acc, scale):
    """`(acc, scale, factor)`: fp16 accumulator rows at the scale taking the largest slope into [1, 2)."""
    exponent = largest.to(tl.int32, bitcast=True) >> 23
    new = tl.minimum(scale, tl.minimum(tl.maximum(254 - exponent, 1), 253))
    acc = acc * (_power_of_two(new) * _power_of_two(254 - scale))[:, None]
    return acc, new, _power_of_two(new)


@triton.jit
def _k_interleaved(a, b):
    """`(a', b')` with `a' @ b' == a @ b`: the shared index k reordered within each group of 8, position
    `4r + q` taking `2q + r`. A TF32 accumulator's thread holds the columns `2q, 2q + 1` of a group and
    the A operand's takes `q, q + 4`: so reordered, `a` is the A operand without shuffles."""
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    N: tl.constexpr = b.shape[1]
    a = tl.reshape(tl.permute(tl.reshape(a, (M, K // 8, 4, 2)), (0, 1, 3, 2)), (M, K))
    b = tl.reshape(tl.permute(tl.reshape(b, (K // 8, 4, 2, N)), (0, 2, 1, 3)), (K, N))
    return a, b


@triton.jit
def _dot_f32_left(a, b, acc, SPLIT_DOT: tl.constexpr, INTERPRET: tl.constexpr,
                  PRECISION: tl.constexpr, K_INTERLEAVED: tl.constexpr):
    """`acc + a @ b` for a float32 `a` rounded to `b`'s dtype; with `SPLIT_DOT`, `a = hi + lo` there, two
    products (without: one rounding of `a`, for a gradient stored in that dtype anyway). With
    `K_INTERLEAVED` (TF32), the shared index reordered (`_k_interleaved`)."""
    if K_INTERLEAVED:
        a, b = _k_interleaved(a, b)
    hi = a.to(b.dtype, fp_downcast_rounding="rtne")
    acc = _dot(hi, b, acc, INTERPRET, PRECISION)
    if SPLIT_DOT:
        lo = (a - hi.to(tl.float32)).to(b.dtype, fp_downcast_rounding="rtne")
        acc = _dot(lo, b, acc, INTERPRET, PRECISION)
    return acc


@triton.jit
def _unscaled(acc, scale, RESCALE: tl.constexpr):
    if RESCALE:
        acc = acc * _power_of_two(254 - scale)[:, None]
    return acc


@triton.jit
def _load_rows(ptr, index, index_ok, dim, dims, dim_ok):
    return tl.load(ptr + index[:, None].to(tl.int64) * dim + dims[None, :],
                   mask=index_ok[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def _per_row(x, ITEMS_FIRST: tl.constexpr):
    """A per-row vector across a logits tile: `[M, 1]`, or `[1, M]` when items come first."""
    if ITEMS_FIRST:
        out = x[None, :]
    else:
        out = x[:, None]
    return out


@triton.jit
def _per_item(x, ITEMS_FIRST: tl.constexpr):
    """A per-item vector across a logits tile: `[1, N]`, or `[N, 1]` when items come first."""
    if ITEMS_FIRST:
        out = x[:, None]
    else:
        out = x[None, :]
    return out


@triton.jit
def _logits(h, table_tile, bias_ptr, positives_ptr, tile_flags_ptr, block, tile, vocab_size, rows,
            row_ok, cols, col_ok, num_targets, FAMILY: tl.constexpr, HAS_BIAS: tl.constexpr,
            INTERPRET: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, ITEMS_FIRST: tl.constexpr = False):
    """The fp32 logits `[M, N]` (`[N, M]`, `E h^T`, with `ITEMS_FIRST`), `-inf` past `V` and where the
    family masks positives (`_masked_positives`)."""
    if ITEMS_FIRST:
        z = _dot(table_tile, tl.trans(h), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), INTERPRET,
                 PRECISION)
    else:
        z = _dot(h, tl.trans(table_tile), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET,
                 PRECISION)
    offset = tl.where(col_ok, 0.0, float("-inf"))  # per item, then one add per logit
    if HAS_BIAS:
        offset += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    z += _per_item(offset, ITEMS_FIRST)
    return _masked_positives(z, positives_ptr, tile_flags_ptr, block, tile, vocab_size, rows, row_ok,
                             cols, num_targets, FAMILY, BLOCK_N, ITEMS_FIRST)


# `log1p(x) / x` on [0, 1] (`x = exp(-|z|)`), degree 9, a near-minimax fit of relative error: with
# `x *` and float32 Horner steps, log1p within 1.7 ulp (libdevice's `log1p`: about 25 instructions and
# a branch). Checked against float64 by `tests/cutbce/test_triton_math.py`.
LOG1P = tl.constexpr((1.0, -0.4999990165233612, 0.33329957723617554, -0.2495407611131668,
                      0.19675642251968384, -0.1530473679304123, 0.10602205246686935,
                      -0.05694521591067314, 0.01984383352100849, -0.0032423315569758415))


@triton.jit
def _log1p_unit(x):
    """`log1p(x)` for `x` in [0, 1], by `LOG1P`: 10 fused multiply-adds."""
    p = tl.full(x.shape, LOG1P[9], tl.float32)
    for k in tl.static_range(8, -1, -1):
        p = p * x + LOG1P[k]
    return x * p


@triton.jit
def _exp2(x, INTERPRET: tl.constexpr):
    """`2^x` by `ex2.approx.ftz` (results below 2^-126 flush to 0: at a logit past -87)."""
    if INTERPRET:
        return tl.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _reciprocal(x, INTERPRET: tl.constexpr):
    """`1 / x` by `rcp.approx.ftz` (1 ulp; 0 past 2^126) for `x >= 1`."""
    if INTERPRET:
        return 1.0 / x
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    return _exp2(x * 1.4426950408889634, INTERPRET)


@triton.jit
def _sigmoid(z, INTERPRET: tl.constexpr):
    """`1 / (1 + exp(-z))`: 0 past `z = -87` (`exp(-z)` past 2^126), 1 at `+inf`."""
    return _reciprocal(1.0 + _exp(-z, INTERPRET), INTERPRET)


@triton.jit
def _softplus_sigmoid(z, INTERPRET: tl.constexpr):
    """`(softplus(z), sigmoid(z))` from one `exp(-|z|)`, both 0 at `-inf`."""
    e = _exp(-tl.abs(z), INTERPRET)
    r = _reciprocal(1.0 + e, INTERPRET)
    softplus = tl.maximum(z, 0.0) + _log1p_unit(e)
    sigmoid = tl.where(z >= 0, r, e * r)
    return softplus, sigmoid


# -- The loss families' parts (`FAMILY`: "bce" or "softmax"; docs/development.md, the protocol) --------


@triton.jit
def _masked_positives(z, positives_ptr, tile_flags_ptr, block, tile, vocab_size, rows, row_ok, cols,
                      num_targets, FAMILY: tl.constexpr, BLOCK_N: tl.constexpr,
                      ITEMS_FIRST: tl.constexpr):
    """`masks_positives`: BCE's logits `-inf` at the rows' positives (int32 `[M, L]`, -1 unused), only
    in the tiles whose flag (int8 `[row blocks, tiles]`) says the row block holds one there."""
    if FAMILY == "bce":
        flag = tl.load(tile_flags_ptr + block * tl.cdiv(vocab_size, BLOCK_N) + tile).to(tl.int32)
        for target in range(num_targets * flag):  # no trip in a tile without a positive
            ids = tl.load(positives_ptr + rows * num_targets + target, mask=row_ok, other=-1)
            hit = _per_item(cols, ITEMS_FIRST) == _per_row(ids, ITEMS_FIRST)
            z = tl.where(hit, float("-inf"), z)
    return z


@triton.jit
def _rows_tile(z, table_tile, row_sum, row_max, grad_h, grad_h_scale, FAMILY: tl.constexpr,
               LOSS: tl.constexpr, GRAD_H: tl.constexpr, SPLIT_DOT: tl.constexpr,
               RESCALE: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
               K_INTERLEAVED: tl.constexpr):
    """`tile` and `merge` in the rows kernel: `(row_sum, row_max, grad_h, grad_h_scale)` with the tile.

    BCE: `sum softplus(z)` and `sigmoid(z) @ E` (`row_max` unused). Softmax: the running
    `(sum exp(z - max), max)` (`LOSS` always) and `exp(z - max) @ E`, rescaled as the max grows."""
    if FAMILY == "softmax":
        # `top` is -inf only while every logit so far is (a bias of -inf): 0 stands in for it.
        top = tl.maximum(row_max, tl.max(z, axis=1))
        shift = tl.where(top == float("-inf"), 0.0, top)
        shrink = _exp(row_max - shift, INTERPRET)
        slope = _exp(z - shift[:, None], INTERPRET)
        row_sum = row_sum * shrink + tl.sum(slope, axis=1)
        row_max = top
        if GRAD_H:
            grad_h = _dot_f32_left(slope, table_tile, grad_h * shrink[:, None], SPLIT_DOT,
                                   INTERPRET, PRECISION, K_INTERLEAVED)
    else:
        softplus, sigmoid = _softplus_sigmoid(z, INTERPRET)
        if LOSS:
            row_sum += tl.sum(softplus, axis=1)
        if GRAD_H:
            if RESCALE:
                grad_h, grad_h_scale, factor = _rescaled(tl.max(sigmoid, axis=1), grad_h,
                                                         grad_h_scale)
                sigmoid = sigmoid * factor[:, None]
            grad_h = _dot_f32_left(sigmoid, table_tile, grad_h, SPLIT_DOT, INTERPRET, PRECISION,
                                   K_INTERLEAVED)
    return row_sum, row_max, grad_h, grad_h_scale


@triton.jit
def _rows_gradient(grad_h, grad_h_scale, FAMILY: tl.constexpr, RESCALE: tl.constexpr):
    """The rows kernel's hidden gradient at its true scale (BCE's fp16 rescaling undone)."""
    if FAMILY == "bce":
        grad_h = _unscaled(grad_h, grad_h_scale, RESCALE)
    return grad_h


@triton.jit
def _store_row_statistics(parts_ptr, split, num_rows, rows, row_ok, row_sum, row_max,
                          FAMILY: tl.constexpr):
    """The rows kernel's partial reduction per split: `[S, M]` sums, and softmax's maxima after them."""
    tl.store(parts_ptr + split * num_rows + rows, row_sum, mask=row_ok)
    if FAMILY == "softmax":
        maxima = parts_ptr + (tl.num_programs(1) + split) * num_rows
        tl.store(maxima + rows, row_max, mask=row_ok)


@triton.jit
def _column_slopes(z, lse_ptr, rows, row_ok, FAMILY: tl.constexpr, INTERPRET: tl.constexpr,
                   ITEMS_FIRST: tl.constexpr):
    """The columns kernel's slopes given the rows' `statistics`: `sigmoid(z)`, or `exp(z - lse)`."""
    if FAMILY == "softmax":
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        slope = _exp(z - _per_row(lse, ITEMS_FIRST), INTERPRET)
    else:
        slope = _sigmoid(z, INTERPRET)
    return slope


# -- The kernels --------------------------------------------------------------------------------------


@triton.jit
def rows_kernel(hidden_ptr, table_ptr, bias_ptr, positives_ptr, tile_flags_ptr, softplus_parts_ptr,
                grad_h_parts_ptr, num_rows, vocab_size, dim, num_targets, tiles_per_split,
                HAS_BIAS: tl.constexpr, LOSS: tl.constexpr, GRAD_H: tl.constexpr,
                SPLIT_DOT: tl.constexpr, RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, FAMILY: tl.constexpr = "bce",
                K_INTERLEAVED: tl.constexpr = False):
    """Per row block x split: BCE's `sum_v softplus(z)` `[S, M]` and `sum_v sigmoid(z) E_v` `[S, M, D]`;
    softmax's (`LOSS` always) `(sum exp(z - max), max)` `[2, S, M]` and `sum_v exp(z - max) E_v`."""
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    h = _load_rows(hidden_ptr, rows, row_ok, dim, dims, dim_ok)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    grad_h = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    grad_h_scale = tl.full((BLOCK_M,), 253, tl.int32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(vocab_size, BLOCK_N))
    for tile in range(first, last):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < vocab_size
        table_tile = _load_rows(table_ptr, cols, col_ok, dim, dims, dim_ok)
        z = _logits(h, table_tile, bias_ptr, positives_ptr, tile_flags_ptr, block, tile, vocab_size,
                    rows, row_ok, cols, col_ok, num_targets, FAMILY, HAS_BIAS, INTERPRET, PRECISION,
                    BLOCK_M, BLOCK_N)
        row_sum, row_max, grad_h, grad_h_scale = _rows_tile(
            z, table_tile, row_sum, row_max, grad_h, grad_h_scale, FAMILY, LOSS, GRAD_H, SPLIT_DOT,
            RESCALE, INTERPRET, PRECISION, K_INTERLEAVED)
    if LOSS:
        _store_row_statistics(softplus_parts_ptr, split, num_rows, rows, row_ok, row_sum, row_max,
                              FAMILY)
    if GRAD_H:
        grad_h = _rows_gradient(grad_h, grad_h_scale, FAMILY, RESCALE)
        out = grad_h_parts_ptr + (split * num_rows + rows[:, None]).to(tl.int64) * dim + dims[None, :]
        tl.store(out, grad_h, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def columns_kernel(hidden_ptr, table_ptr, bias_ptr, positives_ptr, tile_flags_ptr, row_scale_ptr,
                   grad_table_ptr, grad_bias_ptr, num_rows, vocab_size, dim, num_targets,
                   HAS_BIAS: tl.constexpr, GRAD_E: tl.constexpr, GRAD_B: tl.constexpr,
                   SPLIT_DOT: tl.constexpr, RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, FAMILY: tl.constexpr = "bce", lse_ptr=None,
                   K_INTERLEAVED: tl.constexpr = False):
    """Per vocabulary tile, over all rows: `grad_table` `[V, D]` and `grad_bias` `[V]`, float32.

    The slopes: `r_m sigmoid(z)` (BCE) or `r_m exp(z - lse_m)` (softmax), `r` the row scales. On the
    tensor cores the logits come items first (`[N, M]`, `E h^T`): the slopes are the left operand of
    `slopes @ h` as the logits' product leaves them (no transpose through shared memory) and an item's
    sums stay within a warp; full fp32 (`"ieee"`, FMA) keeps rows first, which holds fewer registers.
    """
    ITEMS_FIRST: tl.constexpr = PRECISION == "tf32" or hidden_ptr.dtype.element_ty != tl.float32
    tile = tl.program_id(0)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < vocab_size
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    table_tile = _load_rows(table_ptr, cols, col_ok, dim, dims, dim_ok)
    grad_table = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    grad_table_scale = tl.full((BLOCK_N,), 253, tl.int32)
    grad_bias = tl.zeros((BLOCK_N,), tl.float32)
    for block in range(tl.cdiv(num_rows, BLOCK_M)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        h = _load_rows(hidden_ptr, rows, row_ok, dim, dims, dim_ok)
        z = _logits(h, table_tile, bias_ptr, positives_ptr, tile_flags_ptr, block, tile, vocab_size,
                    rows, row_ok, cols, col_ok, num_targets, FAMILY, HAS_BIAS, INTERPRET, PRECISION,
                    BLOCK_M, BLOCK_N, ITEMS_FIRST)
        slope = _column_slopes(z, lse_ptr, rows, row_ok, FAMILY, INTERPRET, ITEMS_FIRST)
        row_scale = tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0)
        slope = slope * _per_row(row_scale, ITEMS_FIRST)
        if GRAD_E:
            scaled = slope
            if RESCALE:
                grad_table, grad_table_scale, factor = _rescaled(
                    tl.max(tl.abs(slope), axis=1 if ITEMS_FIRST else 0), grad_table, grad_table_scale)
                scaled = slope * _per_item(factor, ITEMS_FIRST)
            if not ITEMS_FIRST:
                scaled = tl.trans(scaled)
            grad_table = _dot_f32_left(scaled, h, grad_table, SPLIT_DOT, INTERPRET, PRECISION,
                                       K_INTERLEAVED)
        if GRAD_B:
            grad_bias += tl.sum(slope, axis=1 if ITEMS_FIRST else 0)
    if GRAD_E:
        grad_table = _unscaled(grad_table, grad_table_scale, RESCALE)
        tl.store(grad_table_ptr + cols[:, None].to(tl.int64) * dim + dims[None, :], grad_table,
                 mask=col_ok[:, None] & dim_ok[None, :])
    if GRAD_B:
        tl.store(grad_bias_ptr + cols, grad_bias, mask=col_ok)
