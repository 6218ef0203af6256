"""The two fused CutBCE Triton kernels: the `[BLOCK_M, BLOCK_N]` logits live only in registers.

Both compute the background of `keras_cutbce.backends.torch.kernel.
dense_pass`: per logit `z = h . E_v + b_v` (one tensor-core product per
tile), the row's positives and the columns past `V` set to `-inf` (where
`softplus` and `sigmoid` are exactly 0), then `softplus(z)` and
`sigmoid(z)` from one `exp(-|z|)` and one `log1p`:

- `rows_kernel`, a grid of row blocks x vocabulary splits: each program
  loops over its split's tiles and writes its partial per-row `sum_v
  softplus(z)` `[M]` and `sum_v sigmoid(z) E_v` `[M, D]` (the caller sums the
  splits in a fixed order: deterministic, no atomics);
- `columns_kernel`, one program per vocabulary tile: loops over all row
  blocks, recomputes the logits and writes the tile's `sum_m r_m
  sigmoid(z_m) h_m` `[BLOCK_N, D]` and `sum_m r_m sigmoid(z_m)` (`r` the
  row scales): each table row is written once, by one program.

The gradient products take the fp32 `sigmoid` tile: with fp32 inputs at
`PRECISION` (`"ieee"` or `"tf32"`); with bf16/fp16 inputs split in a high
and a low half of the input dtype (`SPLIT_DOT`), two tensor-core products
(about 1e-5 relative error instead of the 3e-3 of one rounding). fp16 has
five exponent bits: a slope of a trained model's negatives (`sigmoid(-12) /
V` and less) is below its smallest subnormal, so with fp16 inputs
(`RESCALE`) each output row's slopes are first scaled by a power of two
that brings their largest into `[1, 2)`; the accumulator is kept in the
same units (rescaled, exactly, when a larger slope lowers the scale) and
unscaled once at the end. The
interpreter (`TRITON_INTERPRET=1`, how the suite runs these on CPU) gets
`INTERPRET`: bf16 `tl.dot` is wrong there (triton#11584), so every product
runs on operands cast to fp32, which holds the same values (a product of two
bf16 is exact in fp32), and `log1p` is computed without libdevice.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr, PRECISION: tl.constexpr):
    """Returns `acc + a @ b` with a float32 accumulator (operands of one dtype)."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _power_of_two(exponent_bits):
    """Returns the float32 `2 ** (exponent_bits - 127)` (`exponent_bits` in `[1, 254]`)."""
    return (exponent_bits << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rescaled(largest, acc, scale):
    """Returns `(acc, scale, factor)`: an fp16 accumulator's rows brought to a new scale (`RESCALE`).

    `acc` holds its rows times `2 ** (scale - 127)` (`scale` int32 per row,
    `253` before any slope). `largest` is each row's largest `|slope|` of this
    step: the new scale brings the largest seen so far into `[1, 2)` (a
    power of two: `acc` follows it exactly), and `factor` is what this
    step's slopes are multiplied by before the split (`_unscaled` ends it).
    """
    exponent = largest.to(tl.int32, bitcast=True) >> 23
    new = tl.minimum(scale, tl.minimum(tl.maximum(254 - exponent, 1), 253))
    acc = acc * (_power_of_two(new) * _power_of_two(254 - scale))[:, None]
    return acc, new, _power_of_two(new)


@triton.jit
def _dot_f32_left(a, b, acc, SPLIT_DOT: tl.constexpr, INTERPRET: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Returns `acc + a @ b` for a float32 `a` and `b` in the input dtype.

    With `SPLIT_DOT` (bf16/fp16 inputs), `a = hi + lo` in `b`'s dtype
    (round to nearest even) and both halves are multiplied.
    """
    if SPLIT_DOT:
        hi = a.to(b.dtype, fp_downcast_rounding="rtne")
        lo = (a - hi.to(tl.float32)).to(b.dtype, fp_downcast_rounding="rtne")
        acc = _dot(hi, b, acc, INTERPRET, PRECISION)
        acc = _dot(lo, b, acc, INTERPRET, PRECISION)
    else:
        acc = _dot(a, b, acc, INTERPRET, PRECISION)
    return acc


@triton.jit
def _unscaled(acc, scale, RESCALE: tl.constexpr):
    """Returns `acc` in its true units (see `_rescaled`)."""
    if RESCALE:
        acc = acc * _power_of_two(254 - scale)[:, None]
    return acc


@triton.jit
def _load_rows(ptr, index, index_ok, dim, dims, dim_ok):
    """Returns the rows `index` of a row-major `[*, dim]` tensor, zero where masked."""
    return tl.load(ptr + index[:, None].to(tl.int64) * dim + dims[None, :],
                   mask=index_ok[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def _masked_logits(h, table_tile, bias_ptr, positives_ptr, rows, row_ok, cols, col_ok, num_targets,
                   HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Returns the fp32 logits `[BLOCK_M, BLOCK_N]`, `-inf` at the rows' positives and past `V`.

    `positives_ptr` is int32 `[M, num_targets]`: each row's distinct valid
    ids, `-1` elsewhere (no column matches it).
    """
    z = _dot(h, tl.trans(table_tile), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET,
             PRECISION)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z = tl.where(col_ok[None, :], z, float("-inf"))
    for target in range(num_targets):
        ids = tl.load(positives_ptr + rows * num_targets + target, mask=row_ok, other=-1)
        z = tl.where(cols[None, :] == ids[:, None], float("-inf"), z)
    return z


@triton.jit
def _softplus_sigmoid(z, INTERPRET: tl.constexpr):
    """Returns `(softplus(z), sigmoid(z))` from one `exp(-|z|)`; both exactly 0 at `-inf`.

    `softplus(z) = max(z, 0) + log1p(exp(-|z|))`, with CUDA's `log1p`
    (libdevice), so a very negative logit's softplus keeps float32
    precision. The interpreter has no libdevice: there `log1p(x) = log(u) +
    (x - (u - 1)) / u` with `u = 1 + x` (exact to O(eps^2)).
    """
    e = tl.exp(-tl.abs(z))
    u = 1.0 + e
    r = 1.0 / u
    if INTERPRET:
        log1p = tl.log(u) + (e - (u - 1.0)) * r
    else:
        log1p = libdevice.log1p(e)
    softplus = tl.maximum(z, 0.0) + log1p
    sigmoid = tl.where(z >= 0, r, e * r)
    return softplus, sigmoid


@triton.jit
def rows_kernel(hidden_ptr, table_ptr, bias_ptr, positives_ptr, softplus_parts_ptr, grad_h_parts_ptr,
                num_rows, vocab_size, dim, num_targets, tiles_per_split,
                HAS_BIAS: tl.constexpr, LOSS: tl.constexpr, GRAD_H: tl.constexpr,
                SPLIT_DOT: tl.constexpr, RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Per row block and vocabulary split: the partial `sum_v softplus(z)` and `sum_v sigmoid(z) E_v`.

    Writes `softplus_parts[split, m]` (if `LOSS`) and `grad_h_parts[split,
    m, :]` (if `GRAD_H`) for the block's rows `m`.
    """
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    h = _load_rows(hidden_ptr, rows, row_ok, dim, dims, dim_ok)
    softplus_sum = tl.zeros((BLOCK_M,), tl.float32)
    grad_h = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    grad_h_scale = tl.full((BLOCK_M,), 253, tl.int32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(vocab_size, BLOCK_N))
    for tile in range(first, last):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < vocab_size
        table_tile = _load_rows(table_ptr, cols, col_ok, dim, dims, dim_ok)
        z = _masked_logits(h, table_tile, bias_ptr, positives_ptr, rows, row_ok, cols, col_ok,
                           num_targets, HAS_BIAS, INTERPRET, PRECISION, BLOCK_M, BLOCK_N)
        softplus, sigmoid = _softplus_sigmoid(z, INTERPRET)
        if LOSS:
            softplus_sum += tl.sum(softplus, axis=1)
        if GRAD_H:
            if RESCALE:
                grad_h, grad_h_scale, factor = _rescaled(tl.max(sigmoid, axis=1), grad_h,
                                                         grad_h_scale)
                sigmoid = sigmoid * factor[:, None]
            grad_h = _dot_f32_left(sigmoid, table_tile, grad_h, SPLIT_DOT, INTERPRET, PRECISION)
    if LOSS:
        tl.store(softplus_parts_ptr + split * num_rows + rows, softplus_sum, mask=row_ok)
    if GRAD_H:
        grad_h = _unscaled(grad_h, grad_h_scale, RESCALE)
        out = grad_h_parts_ptr + (split * num_rows + rows[:, None]).to(tl.int64) * dim + dims[None, :]
        tl.store(out, grad_h, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def columns_kernel(hidden_ptr, table_ptr, bias_ptr, positives_ptr, row_scale_ptr, grad_table_ptr,
                   grad_bias_ptr, num_rows, vocab_size, dim, num_targets,
                   HAS_BIAS: tl.constexpr, GRAD_E: tl.constexpr, GRAD_B: tl.constexpr,
                   SPLIT_DOT: tl.constexpr, RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Per vocabulary tile: `sum_m r_m sigmoid(z_m) h_m` and `sum_m r_m sigmoid(z_m)` over all rows.

    Writes the tile's rows of `grad_table` `[V, D]` (if `GRAD_E`) and of
    `grad_bias` `[V]` (if `GRAD_B`), float32.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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
        z = _masked_logits(h, table_tile, bias_ptr, positives_ptr, rows, row_ok, cols, col_ok,
                           num_targets, HAS_BIAS, INTERPRET, PRECISION, BLOCK_M, BLOCK_N)
        _, sigmoid = _softplus_sigmoid(z, INTERPRET)
        slope = sigmoid * tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if GRAD_E:
            scaled = slope
            if RESCALE:
                grad_table, grad_table_scale, factor = _rescaled(
                    tl.max(tl.abs(slope), axis=0), grad_table, grad_table_scale)
                scaled = slope * factor[None, :]
            grad_table = _dot_f32_left(tl.trans(scaled), h, grad_table, SPLIT_DOT, INTERPRET,
                                       PRECISION)
        if GRAD_B:
            grad_bias += tl.sum(slope, axis=0)
    if GRAD_E:
        grad_table = _unscaled(grad_table, grad_table_scale, RESCALE)
        tl.store(grad_table_ptr + cols[:, None].to(tl.int64) * dim + dims[None, :], grad_table,
                 mask=col_ok[:, None] & dim_ok[None, :])
    if GRAD_B:
        tl.store(grad_bias_ptr + cols, grad_bias, mask=col_ok)
