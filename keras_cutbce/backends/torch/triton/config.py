"""The static tile table of the Triton kernels: one configuration per (arch, D, dtype).

No autotuning: a configuration is chosen from this table by the padded
feature width `BLOCK_D` (the next power of two >= D, at least 16), the
operand dtype and the GPU generation (sm_90 and later, or before: what
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
    "KernelConfig", "INTERPRET", "MAX_BLOCK_D", "SPILL_ALLOWANCE", "block_dim", "choose",
    "device_arch", "num_splits", "overridden", "supports",
]


class KernelConfig(NamedTuple):
    """The launch settings of the two kernels for one (D, dtype).

    Attributes:
        rows_block: `(BLOCK_M, BLOCK_N, num_warps, num_stages)` of `rows_kernel`.
        columns_block: the same for `columns_kernel`.
    """

    rows_block: tuple
    columns_block: tuple


# (BLOCK_D, half) -> KernelConfig; "half" is bf16/fp16 operands (fp32: False). Chosen on sm_90 as the
# tiles with the fewest SASS instructions per logit that compile without a register spill (ptxas -v),
# then on sm_80 (`_BEFORE_SM90`); tests/cutbce/test_triton_compile.py checks both. [128 x 128] tiles
# spill at every D.
_WIDE = KernelConfig((128, 64, 8, 2), (128, 64, 8, 2))
_TABLE = {
    (16, True): _WIDE,
    (32, True): _WIDE,
    (64, True): _WIDE,
    (128, True): KernelConfig((128, 64, 8, 2), (64, 64, 4, 2)),
    (256, True): KernelConfig((32, 32, 4, 2), (64, 32, 4, 2)),
    (16, False): _WIDE,
    (32, False): _WIDE,
    (64, False): _WIDE,
    (128, False): KernelConfig((128, 64, 8, 2), (64, 32, 4, 2)),
    (256, False): KernelConfig((32, 32, 4, 2), (32, 32, 4, 2)),
}
# Before Hopper (mma.sync, no wgmma) some tiles need more registers: these replace the table's there.
_BEFORE_SM90 = {
    (64, True): KernelConfig((64, 32, 4, 2), (64, 64, 8, 2)),
    (128, True): KernelConfig((64, 64, 8, 2), (64, 64, 4, 2)),
    (128, False): KernelConfig((64, 64, 8, 2), (64, 32, 4, 2)),
}
# fp32 products at full precision (`"ieee"`, torch's default `"highest"`) run on the FMA units and hold
# more registers: (generation, BLOCK_D) -> the tiles that replace the table's there.
# At D > 128 no tile compiles without spills (32 x 32 spills 24 bytes at 23 warp instructions per logit):
# those run the chunked loop (`supports`), whose cuBLAS products are the better FMA kernels there.
_FULL_FP32 = {
    (80, 32): KernelConfig((128, 32, 8, 2), (128, 64, 8, 2)),
    (80, 64): KernelConfig((64, 64, 8, 2), (128, 64, 8, 2)),
    (80, 128): KernelConfig((128, 32, 8, 2), (64, 32, 4, 2)),
    (90, 128): KernelConfig((32, 32, 4, 2), (128, 32, 8, 2)),
}
_FULL_FP32_MAX_BLOCK_D = 128

# Spills the compile test accepts (bytes per thread): sm_80 fp32 D=64 `columns_kernel` spills 12 bytes
# at every tile tried (128 x 64 is the least; 32 x 32 still spills 32 at 128 registers), stored
# once per tile iteration against 32 logits per thread: a little L1 traffic, no local-memory bound.
SPILL_ALLOWANCE = {(80, 64, "float32", "tf32", "columns"): 12}

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


def supports(dim, dtype=torch.bfloat16, precision="tf32"):
    """Returns True when the kernels take feature width `dim`: `block_dim(dim) <= 256`, or 128 for fp32 at `"ieee"`.

    Example:

    >>> supports(256), supports(257), supports(256, torch.float32, "ieee")
    (True, False, False)
    """
    limit = MAX_BLOCK_D
    if dtype == torch.float32 and precision == "ieee":
        limit = _FULL_FP32_MAX_BLOCK_D
    return block_dim(dim) <= limit


def choose(dim, dtype, interpret, arch=90, precision="tf32"):
    """Returns the `KernelConfig` for feature width `dim`, operand `dtype`, compute capability `arch`.

    `precision` is the `tl.dot` precision of fp32 operands (`"ieee"` or `"tf32"`).

    Example:

    >>> choose(64, torch.bfloat16, interpret=False).rows_block
    (128, 64, 8, 2)
    >>> choose(64, torch.bfloat16, interpret=False, arch=80).rows_block
    (64, 32, 4, 2)
    """
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if interpret:
        return INTERPRET
    assert supports(dim, dtype, precision), (dim, dtype, precision)
    key = (block_dim(dim), dtype != torch.float32)
    generation = 90 if arch >= 90 else 80
    if dtype == torch.float32 and precision == "ieee" and (generation, key[0]) in _FULL_FP32:
        return _FULL_FP32[(generation, key[0])]
    if arch < 90 and key in _BEFORE_SM90:
        return _BEFORE_SM90[key]
    return _TABLE[key]


def device_arch(device):
    """Returns the compute capability of a CUDA `device` as an int (90 for 9.0); 90 elsewhere.

    Example:

    >>> device_arch(torch.device("cpu"))
    90
    """
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


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
