"""The registry's `"triton"` entries: the torch loss passes (`kernel`, `chunked`) with the kernels' `dense_pass`.

The rows kernel gives the loss and hidden gradient (its vocabulary splits
summed here in order: deterministic), the columns kernel the table and
bias gradients. CPU tensors run in the interpreter (`TRITON_INTERPRET=1`).
"""

import functools
import os

import torch

from keras_cutbce.backends.torch import chunked
from keras_cutbce.backends.torch.math import BCE
from keras_cutbce.backends.torch.math import Softmax
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.backends.torch.triton import config
from keras_cutbce.math.coefficients import bce_coefficients

__all__ = [
    "cut_bce", "cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum", "dense_pass",
    "device_problem", "fits", "interpreting", "kernels", "operand_dtype", "triton_precision",
]


def fits(hidden, table, bias):
    """The registry's `FITS` entry: not float64, a width and operands `config.supports` on the device's arch.

    >>> fits(torch.zeros(2, 8), torch.zeros(5, 8), None), fits(torch.zeros(2, 300), torch.zeros(5, 300), None)
    (True, False)
    """
    if compute_dtype(hidden, table, bias) == torch.float64:
        return False
    return config.supports(hidden.shape[1], operand_dtype(hidden), triton_precision(),
                           config.device_arch(hidden.device))


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size=None):
    family = BCE(bce_coefficients(label_smoothing, pos_weight))
    return _PerRow.apply(hidden, table, bias, chunked.as_ids(ids, hidden.device), family)


def cut_bce_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight,
                         chunk_size=None):
    family = BCE(bce_coefficients(label_smoothing, pos_weight))
    return chunked.weighted_sum(family, hidden, table, ids, bias, row_weights, _whole(table),
                                _dense(hidden, table))


def cut_softmax(hidden, table, ids, bias=None, *, label_smoothing=0.0, chunk_size=None):
    family = Softmax(float(label_smoothing), table.shape[0])
    return _PerRow.apply(hidden, table, bias, chunked.as_ids(ids, hidden.device), family)


class _PerRow(torch.autograd.Function):
    """The per-position op in two launches: forward, the rows kernel gives the loss and the hidden gradient of
    a unit cotangent (a row's gradient scales with its cotangent); backward, the columns kernel alone.

    Softmax's column slopes take the rows' log-sum-exp from the forward pass. Rows whose cotangent is 0 add
    exactly 0 (their hidden state may not be finite), as in the chunked loop.
    """

    @staticmethod
    def forward(ctx, hidden, table, bias, ids, family):
        dtype = compute_dtype(hidden, table, bias)
        need_h = ctx.needs_input_grad[0]
        found = []

        def dense(*args, **kwargs):  # keeps the rows' statistics (softmax: `(max, sum exp)`)
            out = _dense(hidden, table)(*args, **kwargs)
            found.append(out[0])
            return out

        ones = torch.ones(hidden.shape[0], dtype=dtype, device=hidden.device)
        loss, grad_h, _, _ = chunked.row_losses(hidden.to(dtype), table, bias, ids, family, _whole(table),
                                                ones if need_h else None, (need_h, False, False), dense=dense)
        lse = family.statistics(found[0]).float().contiguous() if isinstance(family, Softmax) else None
        ctx.save_for_backward(hidden, table, bias, ids, grad_h, lse)
        ctx.family = family
        return loss

    @staticmethod
    def backward(ctx, row_scale):
        hidden, table, bias, ids, unit_grad_h, lse = ctx.saved_tensors
        need_h, need_e, need_b = ctx.needs_input_grad[:3]
        dtype = compute_dtype(hidden, table, bias)
        row_scale = row_scale.to(dtype)
        kept = row_scale != 0
        zero = torch.zeros((), dtype=dtype, device=row_scale.device)
        grad_h = grad_e = grad_b = None
        if need_h:
            grad_h = torch.where(kept[:, None], unit_grad_h * row_scale[:, None], zero).to(hidden.dtype)
        if need_e or need_b:
            if lse is not None:  # a dropped row's slopes exp(z - inf) are 0, whatever its hidden state was
                lse = torch.where(kept, lse, torch.full_like(lse, float("inf")))
            dense = functools.partial(_dense(hidden, table), lse=lse)
            h = chunked.mask_zero_rows(row_scale, hidden.to(dtype))
            _, grad_e, grad_b = chunked.row_gradients(h, table, bias, ids, ctx.family, _whole(table), row_scale,
                                                      (False, need_e, need_b), dense=dense)
            grad_e = None if grad_e is None else grad_e.to(table.dtype)
            grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_e, grad_b, None, None


def _whole(table):
    """The torch passes' tile: all of V (the kernels tile it themselves)."""
    return max(1, table.shape[0])


def cut_softmax_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing,
                             chunk_size=None):
    family = Softmax(float(label_smoothing), table.shape[0])
    return chunked.weighted_sum(family, hidden, table, ids, bias, row_weights, _whole(table),
                                _dense(hidden, table))


def _dense(hidden, table):
    """The torch passes' `dense`: these kernels, over one tile of all of V (they tile it themselves)."""
    return functools.partial(dense_pass, operands=operand_dtype(hidden),
                             stored=(hidden.dtype, table.dtype))


def interpreting():
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def device_problem(device):
    """The registry's `DEVICES` entry: why the kernels cannot run on torch `device`, or None.

    They run on CUDA GPUs of a compute capability in `config.COMPILED_ARCHS`,
    and on CPU in the Triton interpreter.
    """
    if device.type != "cuda":
        if interpreting():
            return None
        return (f'`implementation="triton"` runs CUDA tensors, or CPU tensors in the Triton '
                f"interpreter (TRITON_INTERPRET=1 set before Triton is imported). Received "
                f"tensors on {device}.")
    arch = config.device_arch(device)
    if arch in config.COMPILED_ARCHS:
        return None
    *first, last = (f"sm_{a}" for a in config.COMPILED_ARCHS)
    compiled = f"{', '.join(first)} or {last}" if first else last
    return (f'`implementation="triton"` runs on GPUs of compute capability {compiled}, the ones its '
            f"kernels are compiled and tested for without register spills; {device} is sm_{arch}. "
            f'Use implementation="auto" or "chunked" (the chunked loop) there.')


def kernels(device):
    """The `kernels` module (imports Triton); a ValueError where `device_problem` says why not."""
    problem = device_problem(device)
    if problem:
        raise ValueError(problem)
    try:
        from keras_cutbce.backends.torch.triton import kernels as module
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        raise ImportError(
            '`implementation="triton"` needs Triton: pip install "keras-cutbce-erase[triton-compile]" '
            "(torch's CUDA wheels install it)."
        ) from error

    return module


@torch.compiler.assume_constant_result  # a string Dynamo cannot trace; its global-state guard re-traces
def triton_precision():
    """fp32 operands' `tl.dot` precision: `"ieee"` under torch's `"highest"` matmul precision, else `"tf32"`."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


_HALF = (torch.bfloat16, torch.float16)


def operand_dtype(hidden):
    """The products' dtype (float32 accumulation): autocast's, else bf16/fp16 hidden states', else float32."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _HALF:
        return torch.get_autocast_dtype(device)
    if hidden.dtype in _HALF:
        return hidden.dtype
    return torch.float32


def dense_pass(h, table, bias, tiles, positives, *, loss, row_scale=None, need=(False,) * 3,
               family, stats=None, operands=torch.float32, stored=(torch.float32,) * 2, lse=None):
    """`chunked.dense_pass` by the kernels (`tiles` gives `V` only; `operands`: the products' dtype).

    `stored`: the dtypes the hidden and table gradients are returned in (`config.split_dot`: a gradient
    stored in `operands` anyway takes one rounding of the slopes, then its own).

    Softmax: the rows' `(max, sum exp)` come with the hidden gradient, in one pass (no `stats`); `lse`
    (float32 `[M]`, from an earlier pass) lets the columns kernel run alone.
    """
    softmax = isinstance(family, Softmax)
    if not (softmax or isinstance(family, BCE)) or stats is not None:
        raise NotImplementedError(
            f"The Triton kernels compute BCE and softmax in one pass. Received: family={family!r}, "
            f"stats={stats!r}")
    module = kernels(h.device)
    interpret = interpreting()
    num_rows, dim = h.shape
    vocab_size = tiles.vocab_size
    need_h, need_e, need_b = need if row_scale is not None else (False, False, False)
    hidden = h.to(operands).contiguous()
    table = table.to(operands).contiguous()
    bias = hidden if bias is None else bias.contiguous()
    targets = _target_ids(positives, num_rows, h.device)
    precision = triton_precision()
    settings = config.choose(dim, operands, interpret, config.device_arch(h.device), precision,
                             family="softmax" if softmax else "bce")
    split_h, split_e = (config.split_dot(operands, dtype) for dtype in stored)
    flags = dict(
        RESCALE=operands == torch.float16,
        INTERPRET=interpret, PRECISION=precision, BLOCK_D=config.block_dim(dim),
        FAMILY="softmax" if softmax else "bce", HAS_BIAS=bias is not hidden,
        K_INTERLEAVED=config.k_interleaved(dim, operands, config.device_arch(h.device), precision),
    )
    row_sums = grad_h = grad_e = grad_b = None
    f32 = dict(dtype=torch.float32, device=h.device)
    # Softmax's column slopes need each row's log-sum-exp: the rows kernel runs first unless it is given.
    rows_loss = loss or (softmax and lse is None and (need_h or need_e or need_b))

    if rows_loss or need_h:
        block_m, block_n, warps, stages = settings.rows_block
        num_tiles = -(-vocab_size // block_n)
        tile_flags = _tile_flags(targets, block_m, block_n, vocab_size, softmax)
        options = dict(LOSS=rows_loss, GRAD_H=need_h, SPLIT_DOT=split_h, BLOCK_M=block_m, BLOCK_N=block_n,
                       num_warps=warps, num_stages=stages, **flags)
        dtypes = (hidden.dtype, table.dtype, bias.dtype, targets.dtype, tile_flags.dtype,
                  torch.float32 if rows_loss else hidden.dtype, torch.float32 if need_h else hidden.dtype)
        programs = _rows_programs_per_sm(h.device, dtypes, tuple(options.items()))
        tiles_per_split = -(-num_tiles // config.num_splits(num_rows, num_tiles, block_m, h.device, programs))
        splits = -(-num_tiles // tiles_per_split)
        parts = torch.empty(2 if softmax else 1, splits, num_rows, **f32) if rows_loss else hidden
        grad_h_parts = torch.empty(splits, num_rows, dim, **f32) if need_h else hidden
        module.rows_kernel[(-(-num_rows // block_m), splits)](
            hidden, table, bias, targets, tile_flags, parts, grad_h_parts,
            num_rows, vocab_size, dim, targets.shape[1], tiles_per_split, **options,
        )
        if softmax:  # the splits' `(max, sum exp)` merged; their gradients to the common max
            sums, maxima = parts
            top = maxima.amax(0)
            weights = torch.exp(maxima - top)
            total = (weights * sums).sum(0)
            row_sums = torch.stack([top, total])
            lse = top + torch.log(total)
            if need_h:
                grad_h = torch.einsum("sm,smd->md", weights, grad_h_parts)
                grad_h.mul_((row_scale / total)[:, None])
        else:
            row_sums = parts[0].sum(0) if loss else None
            if need_h:
                grad_h = grad_h_parts.sum(0).mul_(row_scale[:, None])

    if need_e or need_b:
        block_m, block_n, warps, stages = settings.columns_block
        grad_e = torch.empty(vocab_size, dim, **f32) if need_e else hidden
        grad_b = torch.empty(vocab_size, **f32) if need_b else hidden
        if not (rows_loss or need_h) or settings.rows_block[:2] != (block_m, block_n):
            tile_flags = _tile_flags(targets, block_m, block_n, vocab_size, softmax)
        module.columns_kernel[(-(-vocab_size // block_n),)](
            hidden, table, bias, targets, tile_flags, row_scale.float().contiguous(), grad_e, grad_b,
            num_rows, vocab_size, dim, targets.shape[1],
            GRAD_E=need_e, GRAD_B=need_b, SPLIT_DOT=split_e, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages, lse_ptr=lse, **flags,
        )
        grad_e = grad_e if need_e else None
        grad_b = grad_b if need_b else None
    return (row_sums if loss else None), grad_h, grad_e, grad_b


# The rows kernel's programs per SM by device, tensor dtypes and compile options (`_rows_programs_per_sm`).
_PROGRAMS = {}


@torch.compiler.assume_constant_result  # computed when traced: Dynamo does not trace Triton's compiler
def _rows_programs_per_sm(device, dtypes, options):
    """How many programs of the rows kernel an SM holds (`config.programs_per_sm`); 1 in the interpreter.

    Read from the kernel compiled before its first launch (`JITFunction.warmup`, nothing runs) for
    aligned tensors of `dtypes` and every integer argument 16, whatever the shapes: each call with
    these options, the first too, splits the vocabulary alike. `options`: the launch's keyword
    arguments, as items.
    """
    key = (device, dtypes, options)
    if key not in _PROGRAMS:
        launch = dict(options)
        compiled = kernels(device).rows_kernel.warmup(*dtypes, *(16,) * 5, grid=(1,), **launch)
        programs = 1
        if compiled is not None:  # None in the interpreter
            compiled.run  # noqa: B018 - loads the kernel on the GPU, which reads its registers
            programs = config.programs_per_sm(compiled.n_regs, launch["num_warps"],
                                              compiled.metadata.shared, config.device_arch(device))
        _PROGRAMS[key] = programs
    return _PROGRAMS[key]


def _tile_flags(targets, block_m, block_n, vocab_size, softmax):
    """int8 `[row blocks, tiles]` (+ 1 slot for padding ids): 1 where the row block has a positive in the tile.

    BCE's kernels mask positives only there (at L = 8, 128 x 64 tiles and V = 876000: about 7% of tiles,
    for uniform ids); `M V / (BLOCK_M BLOCK_N)` bytes (int32 offsets in the kernels). Softmax masks none:
    `targets` stands in.
    """
    if softmax:
        return targets
    num_rows = targets.shape[0]
    num_tiles = -(-vocab_size // block_n)
    size = -(-num_rows // block_m) * num_tiles
    flags = torch.zeros(size + 1, dtype=torch.int8, device=targets.device)
    blocks = torch.arange(num_rows, device=targets.device)[:, None] // block_m
    index = torch.where(targets >= 0, blocks * num_tiles + targets.long() // block_n, size)
    return flags.index_fill_(0, index.reshape(-1), 1)


def _target_ids(positives, num_rows, device):
    """int32 `[M, L]`: each row's valid distinct ids (`< V < 2^31`), `-1` at padding and repeats."""
    if positives.empty:
        return torch.full((num_rows, 1), -1, dtype=torch.int32, device=device)
    minus_one = torch.full((), -1, dtype=positives.safe.dtype, device=device)
    return torch.where(positives.keep, positives.safe, minus_one).to(torch.int32).contiguous()
