"""The static tile table of the Triton kernels: one configuration per (arch, D, dtype).

No autotuning: a configuration is chosen from this table by the padded
feature width `BLOCK_D` (the next power of two >= D, at least 16) and the
operand dtype, the same on every CUDA GPU of compute capability >= 8.0 (what
the kernels were compiled for without a GPU: `benchmarks/cutbce_triton.py
--deviceless` prints registers, spills and shared memory of each entry for
sm_80 and sm_90; the GPU check's sweep is what retunes it). The rule: keep a
`[BLOCK_M, BLOCK_N]` fp32 logits tile and the `[BLOCK, BLOCK_D]` fp32
gradient accumulator in registers without spills, so the tiles shrink as
`BLOCK_D` grows.

The interpreter (CPU tensors) runs small tiles instead (`INTERPRET`), so
odd test shapes cover several row blocks, vocabulary tiles and splits.
"""

import contextlib
from typing import NamedTuple

import torch

__all__ = [
    "KernelConfig", "INTERPRET", "MAX_BLOCK_D", "block_dim", "choose", "num_splits", "overridden",
    "supports",
]


class KernelConfig(NamedTuple):
    """The launch settings of the two kernels for one (D, dtype).

    Attributes:
        rows_block: `(BLOCK_M, BLOCK_N, num_warps, num_stages)` of `rows_kernel`.
        columns_block: the same for `columns_kernel`.
    """

    rows_block: tuple
    columns_block: tuple


# (BLOCK_D, half) -> KernelConfig; "half" is bf16/fp16 operands (fp32: False).
_TABLE = {
    (16, True): KernelConfig((128, 128, 8, 3), (128, 128, 8, 3)),
    (32, True): KernelConfig((128, 128, 8, 3), (128, 128, 8, 3)),
    (64, True): KernelConfig((128, 128, 8, 3), (128, 128, 8, 2)),
    (128, True): KernelConfig((128, 64, 8, 2), (64, 128, 8, 2)),
    (256, True): KernelConfig((64, 64, 8, 2), (64, 64, 8, 2)),
    (16, False): KernelConfig((128, 128, 8, 3), (128, 128, 8, 3)),
    (32, False): KernelConfig((128, 128, 8, 3), (128, 128, 8, 2)),
    (64, False): KernelConfig((128, 64, 8, 2), (64, 128, 8, 2)),
    (128, False): KernelConfig((64, 64, 8, 2), (64, 64, 8, 2)),
    (256, False): KernelConfig((64, 32, 8, 2), (32, 64, 8, 2)),
}

INTERPRET = KernelConfig((16, 32, 1, 1), (16, 32, 1, 1))

# Programs of `rows_kernel` aimed at per streaming multiprocessor.
_PROGRAMS_PER_SM = 2
# The interpreter's stand-in for the SM count (so small tests split V).
_INTERPRET_SMS = 2


_OVERRIDE = []


@contextlib.contextmanager
def overridden(settings):
    """Runs the kernels with `settings` (a `KernelConfig`) inside the block: the GPU check's sweep.

    Example:

    >>> with overridden(INTERPRET):
    ...     choose(64, torch.float32, interpret=False) == INTERPRET
    True
    """
    _OVERRIDE.append(KernelConfig(*settings))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def block_dim(dim):
    """Returns `BLOCK_D`: the next power of two >= `dim`, at least 16 (`tl.dot`'s minimum).

    Example:

    >>> block_dim(5), block_dim(64), block_dim(65)
    (16, 64, 128)
    """
    return max(16, 1 << max(0, dim - 1).bit_length())


MAX_BLOCK_D = 256


def supports(dim):
    """Returns True when the kernels take feature width `dim` (`block_dim(dim) <= 256`).

    Example:

    >>> supports(256), supports(257)
    (True, False)
    """
    return block_dim(dim) <= MAX_BLOCK_D


def choose(dim, dtype, interpret):
    """Returns the `KernelConfig` for feature width `dim` and operand `dtype`.

    Example:

    >>> choose(64, torch.bfloat16, interpret=False).rows_block
    (128, 128, 8, 3)
    """
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if interpret:
        return INTERPRET
    assert supports(dim), dim
    return _TABLE[(block_dim(dim), dtype != torch.float32)]


def num_splits(num_rows, num_tiles, block_rows, device):
    """Returns how many vocabulary splits `rows_kernel` runs, so the grid fills the GPU.

    Example:

    >>> num_splits(37, 10, 16, torch.device("cpu"))
    2
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = _INTERPRET_SMS
    row_blocks = -(-num_rows // block_rows)
    wanted = -(-_PROGRAMS_PER_SM * sms // row_blocks)
    return max(1, min(num_tiles, wanted))
