"""The registry's `"triton"` entry points: the torch passes with the fused Triton `dense_pass`.

The autograd Functions, the positives, the sparse part and every semantic
(bias, label smoothing, `pos_weight`, padding and repeated ids, wide ids,
zero-weight rows) are those of `keras_cutbce.backends.torch.chunked`; only
the dense background runs in the fused kernels (`launch.dense_pass`), so the
`[M, tile]` logits never reach device memory. Float64 inputs, `D > 256`, and
fp32 products at full precision (torch's default) with `D > 128` run the
chunked loop (the kernels keep a whole `[rows, D]` block in registers, and
no tile fits there without spills).
"""

import functools
import importlib.util

import torch

from keras_cutbce.backends.torch import chunked
from keras_cutbce.backends.torch.math import compute_dtype
from keras_cutbce.math.tiling import default_chunk_size

__all__ = ["available", "cut_bce", "cut_bce_weighted_sum"]


def available():
    """Returns True when Triton is installed (what `implementation="auto"` needs for these kernels).

    Example:

    >>> isinstance(available(), bool)
    True
    """
    return importlib.util.find_spec("triton") is not None


def _dense(hidden, table, bias):
    """Returns the `dense` of the torch passes, or None: the inputs run the chunked loop.

    That is float64, `D > 256`, and fp32 products at full precision with `D > 128` (`config.supports`).
    """
    from keras_cutbce.backends.torch.triton import config
    from keras_cutbce.backends.torch.triton import launch

    if compute_dtype(hidden, table, bias) == torch.float64:
        return None
    operands = launch.operand_dtype(hidden)
    if not config.supports(hidden.shape[1], operands, launch.triton_precision()):
        return None

    return functools.partial(launch.dense_pass, operands=operands)


def cut_bce(hidden, table, ids, bias=None, *, label_smoothing=0.0, pos_weight=1.0, chunk_size=None):
    """Computes the per-row binary cross-entropy over the whole vocabulary with the fused kernels.

    What `keras_cutbce.backends.torch.chunked.cut_bce` computes, with the
    same exact gradients for any cotangent; the logits stay in registers
    (memory O(M * D * splits + V * D)). CUDA tensors run the compiled
    kernels, CPU tensors the Triton interpreter. The fp32 products run at
    torch's fp32 matmul precision (`torch.get_float32_matmul_precision()`:
    `"highest"`, the default, is full fp32; `"high"` is TF32), as a dense
    `h @ E.T` would; bf16/fp16 hidden states (a Keras mixed precision
    policy's compute dtype) or `torch.autocast` multiply in that dtype, the
    table cast to it, with fp32 accumulation (`launch.operand_dtype`). The kernels choose their tiles (`config.choose`);
    `chunk_size` is accepted and unused, except by float64 inputs (chunked).

    Args:
        hidden: float `[M, D]` (`D > 256`, or `D > 128` for fp32 at full precision: the chunked loop).
        table: float `[V, D]`.
        ids: integer `[M, L]` target ids; outside `[0, V)` is padding.
        bias: optional float `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: ignored (float64 inputs: the chunked tile width).

    Returns:
        Float32 loss `[M]`.

    Example (on a GPU, `h` and `table` would be CUDA tensors; float64 runs the chunked loop):

    >>> h = torch.randn(5, 8, dtype=torch.float64)
    >>> table = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    >>> ids = torch.tensor([[1, 2], [3, -1], [5, 5], [7, 99], [0, 39]])
    >>> loss = cut_bce(h, table, ids)
    >>> tuple(loss.shape), loss.dtype
    ((5,), torch.float64)
    """
    dense = _dense(hidden, table, bias)
    if dense is None:
        return chunked.cut_bce(hidden, table, ids, bias, label_smoothing=label_smoothing,
                               pos_weight=pos_weight, chunk_size=_tile(hidden, table, chunk_size))
    return chunked.run_cut_bce(dense, hidden, table, ids, bias, label_smoothing=label_smoothing,
                               pos_weight=pos_weight, tile=_one_tile(table))


def cut_bce_weighted_sum(hidden, table, ids, bias, row_weights, *, label_smoothing, pos_weight,
                         chunk_size=None):
    """Computes `sum_m row_weights[m] * cut_bce(...)[m]` with the gradients fused into the forward pass.

    As `keras_cutbce.backends.torch.chunked.cut_bce_weighted_sum` (the
    backward pass only scales the gradients), with the fused kernels of
    `cut_bce`: `rows_kernel` writes the loss and the hidden gradient,
    `columns_kernel` the table and bias gradients.

    Example:

    >>> h = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    >>> table = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    >>> ids = torch.tensor([[1, 2], [3, -1], [5, 5], [7, 99]])
    >>> w = torch.tensor([0.25, 0.25, 0.0, 0.5], dtype=torch.float64)
    >>> total = cut_bce_weighted_sum(h, table, ids, None, w, label_smoothing=0.0, pos_weight=1.0)
    >>> total.backward(); h.grad[2].abs().max().item()
    0.0
    """
    dense = _dense(hidden, table, bias)
    if dense is None:
        return chunked.cut_bce_weighted_sum(
            hidden, table, ids, bias, row_weights, label_smoothing=label_smoothing,
            pos_weight=pos_weight, chunk_size=_tile(hidden, table, chunk_size))
    return chunked.run_weighted_sum(dense, hidden, table, ids, bias, row_weights,
                                    label_smoothing=label_smoothing, pos_weight=pos_weight,
                                    tile=_one_tile(table))


def _one_tile(table):
    """The torch passes' tile: one over all of V (the kernels tile it themselves)."""
    return max(1, table.shape[0])


def _tile(hidden, table, chunk_size):
    """The chunked loop's tile for float64 inputs."""
    return chunk_size or default_chunk_size(max(1, hidden.shape[0]), max(1, table.shape[0]))
