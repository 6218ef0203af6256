"""The registry's `"triton"` entries: the torch CutBCE passes with the fused kernels' `dense_pass`.

`dense_pass` has the signature of `keras_cutbce.backends.torch.kernel.
dense_pass` (the background `sum_v softplus(z_v)` over each row's negatives
and its gradients), so the torch passes (`kernel.row_losses`, the sparse
part, the autograd Functions of `keras_cutbce.backends.torch.chunked`, so
every semantic) run unchanged around it, and the `[M, tile]` logits never
reach device memory. Per call:

- the loss and the hidden gradient: `rows_kernel` over row blocks x
  vocabulary splits, its partial sums added here in split order;
- the table and bias gradients: `columns_kernel` over vocabulary tiles.

CUDA tensors run the compiled kernels; CPU tensors run them in the Triton
interpreter, which needs `TRITON_INTERPRET=1` in the environment before
Triton is first imported (Triton reads it when its own `@triton.jit`
helpers are created, at import): the suite runs these in a child process.
"""

import functools
import os

import torch

from keras_cutbce.backends.torch import chunked
from keras_cutbce.backends.torch.math import BCE
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.backends.torch.triton import config

__all__ = [
    "cut_bce", "cut_bce_weighted_sum", "dense_pass", "fits", "interpreting", "kernels",
    "operand_dtype", "triton_precision",
]


def fits(hidden, table, bias):
    """Returns True when the kernels take these inputs (the registry's `FITS` entry).

    Not float64, and `config.supports` the feature width (the kernels keep a
    whole `[rows, D]` block in registers: `D <= 256`, or `D <= 128` for fp32
    products at full precision); other inputs run the chunked loop.

    Example:

    >>> fits(torch.zeros(2, 8), torch.zeros(5, 8), None), fits(torch.zeros(2, 300), torch.zeros(5, 300), None)
    (True, False)
    """
    if compute_dtype(hidden, table, bias) == torch.float64:
        return False
    return config.supports(hidden.shape[1], operand_dtype(hidden), triton_precision())


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size=None):
    """`chunked.cut_bce` with the fused kernels (the contract: `keras_cutbce.registry`).

    CUDA tensors run the compiled kernels, CPU tensors the Triton interpreter;
    the products take `operand_dtype(hidden)` at `triton_precision()` and the
    kernels choose their tiles (`chunk_size` is unused). Inputs must `fits`.
    """
    return chunked.run_cut_bce(_dense(hidden), hidden, table, ids, bias,
                               label_smoothing=label_smoothing, pos_weight=pos_weight,
                               tile=max(1, table.shape[0]))


def cut_bce_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight,
                         chunk_size=None):
    """`chunked.cut_bce_weighted_sum` with the fused kernels, as `cut_bce`."""
    return chunked.run_weighted_sum(_dense(hidden), hidden, table, ids, bias, row_weights,
                                    label_smoothing=label_smoothing, pos_weight=pos_weight,
                                    tile=max(1, table.shape[0]))


def _dense(hidden):
    """The torch passes' `dense`: these kernels, over one tile of all of V (they tile it themselves)."""
    return functools.partial(dense_pass, operands=operand_dtype(hidden))


def interpreting():
    """Returns True when Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`).

    Example:

    >>> isinstance(interpreting(), bool)
    True
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernels(device):
    """Returns the `kernels` module (imports Triton) for tensors on `device`.

    Raises:
        ValueError: for tensors that are not on a CUDA device outside the interpreter.
        ImportError: without Triton.
    """
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f'`implementation="triton"` runs CUDA tensors, or CPU tensors in the Triton '
            f"interpreter (TRITON_INTERPRET=1 set before Triton is imported). Received "
            f"tensors on {device}."
        )
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


def triton_precision():
    """Returns the `tl.dot` input precision of fp32 operands: torch's fp32 matmul precision.

    `"ieee"` under `torch.get_float32_matmul_precision() == "highest"`
    (torch's default: full fp32, what a dense `h @ E.T` computes), `"tf32"`
    under `"high"` or `"medium"` (or `torch.backends.cuda.matmul.allow_tf32`).

    Example:

    >>> triton_precision()
    'ieee'
    """
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


_HALF = (torch.bfloat16, torch.float16)


def operand_dtype(hidden):
    """Returns the dtype the kernels' products take (they accumulate in float32 whatever it is).

    The compute dtype, as a matmul of these tensors would get it: under
    `torch.autocast` on their device, the autocast dtype; otherwise the
    hidden states' dtype when it is bf16/fp16 (a Keras mixed precision
    model's output is in its policy's compute dtype, and a Keras layer casts
    its float32 weights to it: so is the table here); otherwise float32.

    Example:

    >>> operand_dtype(torch.zeros(1, dtype=torch.bfloat16))
    torch.bfloat16
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _HALF:
        return torch.get_autocast_dtype(device)
    if hidden.dtype in _HALF:
        return hidden.dtype
    return torch.float32


def dense_pass(h, table, bias, tiles, positives, *, loss, row_scale=None, need=(False,) * 3,
               family, stats=None, operands=torch.float32):
    """Returns the background `sum_v softplus(z_v)` over each row's negatives, and its gradients.

    As `keras_cutbce.backends.torch.kernel.dense_pass` (same arguments and
    results, float32), computed by the fused kernels: the logits never
    leave the GPU's registers. `operands` is the dtype of the products'
    inputs (`operand_dtype` of the caller's hidden states: `h` arrives in
    float32, an exact copy when the input was bf16/fp16); `tiles` is used for
    `V` only.

    The parity tests (`tests/cutbce/test_triton_interpreter.py`) compare it,
    through the public op, with the dense reference and Keras's BCE. The
    loss family is compiled into the kernels: `family` must be `BCE`.
    """
    if not isinstance(family, BCE):
        raise NotImplementedError(f"The Triton kernels compute BCE only. Received: family={family!r}")
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
    settings = config.choose(dim, operands, interpret, config.device_arch(h.device), precision)
    flags = dict(
        SPLIT_DOT=operands != torch.float32, RESCALE=operands == torch.float16,
        INTERPRET=interpret, PRECISION=precision,
        BLOCK_D=config.block_dim(dim),
    )
    softplus_sum = grad_h = grad_e = grad_b = None
    f32 = dict(dtype=torch.float32, device=h.device)

    if loss or need_h:
        block_m, block_n, warps, stages = settings.rows_block
        num_tiles = -(-vocab_size // block_n)
        splits = config.num_splits(num_rows, num_tiles, block_m, h.device)
        tiles_per_split = -(-num_tiles // splits)
        splits = -(-num_tiles // tiles_per_split)
        softplus_parts = torch.empty(splits, num_rows, **f32) if loss else hidden
        grad_h_parts = torch.empty(splits, num_rows, dim, **f32) if need_h else hidden
        grid = (-(-num_rows // block_m), splits)
        module.rows_kernel[grid](
            hidden, table, bias, targets, softplus_parts, grad_h_parts,
            num_rows, vocab_size, dim, targets.shape[1], tiles_per_split,
            HAS_BIAS=bias is not hidden, LOSS=loss, GRAD_H=need_h, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
        )
        if loss:
            softplus_sum = softplus_parts.sum(0)
        if need_h:
            grad_h = grad_h_parts.sum(0).mul_(row_scale[:, None])

    if need_e or need_b:
        block_m, block_n, warps, stages = settings.columns_block
        grad_e = torch.empty(vocab_size, dim, **f32) if need_e else hidden
        grad_b = torch.empty(vocab_size, **f32) if need_b else hidden
        module.columns_kernel[(-(-vocab_size // block_n),)](
            hidden, table, bias, targets, row_scale.float().contiguous(), grad_e, grad_b,
            num_rows, vocab_size, dim, targets.shape[1],
            HAS_BIAS=bias is not hidden, GRAD_E=need_e, GRAD_B=need_b, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
        )
        grad_e = grad_e if need_e else None
        grad_b = grad_b if need_b else None
    return softplus_sum, grad_h, grad_e, grad_b


def _target_ids(positives, num_rows, device):
    """Returns int32 `[M, L]`: each row's valid distinct ids, `-1` at padding and repeats.

    A kept id is in `[0, V)`, so below 2^31 (a table of 2^31 rows is not a
    GPU's); every id that was `>= 2^31` was padding and is `-1` here.
    """
    if positives.empty:
        return torch.full((num_rows, 1), -1, dtype=torch.int32, device=device)
    minus_one = torch.full((), -1, dtype=positives.safe.dtype, device=device)
    return torch.where(positives.keep, positives.safe, minus_one).to(torch.int32).contiguous()
