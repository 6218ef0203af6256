"""The static tile table of the Triton kernels (no autotuning): one configuration per (arch, D, dtype).

The rule: the fp32 logits tile and gradient accumulator stay in registers
without spills (`benchmarks/cutbce_triton.py --deviceless`); the
interpreter runs small tiles (`INTERPRET`) so test shapes span several.
"""

import contextlib
from typing import NamedTuple

import torch

__all__ = [
    "KernelConfig", "COMPILED_ARCHS", "HALF_ONLY_ARCHS", "INTERPRET", "MAX_BLOCK_D", "block_dim", "choose",
    "device_arch", "k_interleaved", "num_splits", "overridden", "programs_per_sm", "split_dot", "supports",
]


class KernelConfig(NamedTuple):
    """`(BLOCK_M, BLOCK_N, num_warps, num_stages)` of `rows_kernel` and of `columns_kernel`."""

    rows_block: tuple
    columns_block: tuple


# (BLOCK_D, half) -> KernelConfig; "half" is bf16/fp16 operands (fp32: False). Chosen on sm_90 as the
# tiles with the fewest SASS instructions per logit that compile without a register spill (ptxas -v),
# then on sm_80 (`_BEFORE_SM90`); tests/cutbce/test_triton_compile.py checks both. [128 x 128] tiles
# spill at every D.
_WIDE = KernelConfig((128, 64, 8, 2), (64, 128, 8, 2))
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
    (80, 32): KernelConfig((128, 32, 8, 2), (64, 64, 4, 2)),
    (80, 64): KernelConfig((64, 64, 8, 2), (128, 64, 8, 2)),
    (80, 128): KernelConfig((32, 32, 4, 2), (32, 64, 4, 2)),
    (90, 128): KernelConfig((32, 32, 4, 2), (128, 32, 8, 2)),
}
_FULL_FP32_MAX_BLOCK_D = 128
# float16 operands: the columns kernel's `RESCALE` (the table gradient's per-item scale) holds more
# registers than bfloat16's tiles have: (generation, BLOCK_D) -> its tiles where bfloat16's spill.
_FLOAT16_COLUMNS = {
    (80, 64): (128, 32, 8, 2),
    (80, 128): (128, 64, 8, 2),
    (80, 256): (32, 32, 4, 1),
    (90, 128): (32, 64, 4, 2),
    (90, 256): (32, 32, 4, 1),
}
# (family, generation, BLOCK_D, operands) -> {kernel: tiles} replacing the above where they spill
# (the least instructions per logit of those that do not): the families schedule differently.
_SMALL = (32, 32, 4, 2)
_REPLACE = {
    ("bce", 80, 128, "float32-ieee"): {"rows": (64, 64, 8, 2)},
    ("bce", 80, 128, "float32-tf32"): {"columns": (128, 64, 8, 2)},
    ("bce", 80, 256, "float16"): {"rows": (32, 64, 4, 2)},
    ("bce", 90, 32, "float32-ieee"): {"rows": (128, 32, 8, 2)},
    ("bce", 90, 64, "float32-ieee"): {"rows": (128, 32, 8, 2)},
    ("bce", 90, 128, "float32-ieee"): {"rows": (32, 64, 8, 2)},
    ("bce", 90, 256, "float32-tf32"): {"rows": (64, 64, 8, 2)},
    ("softmax", 80, 32, "bfloat16"): {"rows": (64, 64, 4, 2)},
    ("softmax", 80, 128, "bfloat16"): {"columns": (128, 64, 8, 2)},
    ("softmax", 80, 32, "float32-ieee"): {"columns": _SMALL},
    ("softmax", 80, 64, "float32-ieee"): {"rows": _SMALL, "columns": _SMALL},
    ("softmax", 80, 128, "float32-ieee"): {"rows": _SMALL, "columns": (16, 32, 4, 2)},
    ("softmax", 80, 64, "float32-tf32"): {"columns": _SMALL},
    ("softmax", 80, 128, "float32-tf32"): {"rows": (64, 64, 4, 2), "columns": _SMALL},
    ("softmax", 80, 256, "float32-tf32"): {"columns": (32, 32, 4, 1)},
    ("softmax", 90, 32, "float32-ieee"): {"rows": _SMALL, "columns": _SMALL},
    ("softmax", 90, 64, "float32-ieee"): {"rows": (32, 32, 4, 1), "columns": _SMALL},
    ("softmax", 90, 128, "float32-ieee"): {"columns": _SMALL},
    ("softmax", 80, 128, "float16"): {"columns": (64, 64, 8, 2)},
    ("softmax", 90, 128, "float16"): {"columns": (64, 64, 4, 2)},
}

# The compute capabilities the kernels run on: those whose compile the suite tests without spills
# (tests/cutbce/test_triton_compile.py). sm_70 and sm_75 spill about 700 bytes a thread; sm_120 asks
# for more shared memory per block than it has (fp32 TF32, D = 128); others are not compiled.
COMPILED_ARCHS = (80, 86, 89, 90, 100)
# Of those, the ones where only 16-bit operands compile without spills with the table's tiles (fp32: 6 of
# 30 configurations spill on sm_86 / sm_89, 4 on sm_100; one asks for 128 KiB of shared memory): fp32 runs
# the chunked loop there.
HALF_ONLY_ARCHS = (86, 89, 100)

INTERPRET = KernelConfig((16, 32, 1, 1), (16, 32, 1, 1))

# The interpreter's stand-in for the SM count (so small tests split V).
_INTERPRET_SMS = 6
# Per SM: registers, warps (48 on sm_86 and sm_89), programs; shared memory (bytes) by arch, 1 KiB of it
# reserved per program.
_SM_REGISTERS, _SM_WARPS, _SM_PROGRAMS = 65536, 64, 32
_SM_FEWER_WARPS = {86: 48, 89: 48}
_SM_SHARED = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024, 90: 228 * 1024,
              100: 228 * 1024}


_OVERRIDE = []


@contextlib.contextmanager
def overridden(settings):
    """Runs the kernels with `settings` (a `KernelConfig`) inside the block: the GPU check's sweep."""
    _OVERRIDE.append(KernelConfig(*settings))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def block_dim(dim):
    """`BLOCK_D`: the next power of two >= `dim`, at least 16 (`tl.dot`'s minimum).

    >>> block_dim(5), block_dim(64), block_dim(65)
    (16, 64, 128)
    """
    return max(16, 1 << max(0, dim - 1).bit_length())


MAX_BLOCK_D = 256


def split_dot(operands, stored):
    """Whether a gradient product splits its float32 slopes into a high and a low half of `operands`
    (`SPLIT_DOT`): for 16-bit operands, unless the gradient is stored in `operands` anyway."""
    return operands not in (torch.float32, stored)


# TF32 gradient products take the slopes in the accumulator's own order (`K_INTERLEAVED`) up to this
# `BLOCK_D`, by generation: wider, reordering the other operand holds registers that spill or cost more
# instructions than the shuffles it saves (tools/triton_sass.py, docs/cutbce.md).
_K_INTERLEAVED_MAX_BLOCK_D = {80: 32, 90: 64}


def k_interleaved(dim, dtype, arch=90, precision="tf32"):
    """Whether the kernels' gradient products reorder their shared index (`K_INTERLEAVED`): fp32 at TF32.

    >>> k_interleaved(64, torch.float32), k_interleaved(64, torch.float32, arch=80)
    (True, False)
    """
    generation = 90 if arch >= 90 else 80
    return (dtype == torch.float32 and precision == "tf32"
            and block_dim(dim) <= _K_INTERLEAVED_MAX_BLOCK_D[generation])


def supports(dim, dtype=torch.bfloat16, precision="tf32", arch=90):
    """Whether the kernels take feature width `dim`: `block_dim(dim) <= 256`, or 128 for fp32 at `"ieee"`;
    16-bit operands only on `HALF_ONLY_ARCHS`.

    >>> supports(64), supports(64, torch.float32, arch=89), supports(300)
    (True, False, False)
    """
    if dtype == torch.float32 and arch in HALF_ONLY_ARCHS:
        return False
    limit = MAX_BLOCK_D
    if dtype == torch.float32 and precision == "ieee":
        limit = _FULL_FP32_MAX_BLOCK_D
    return block_dim(dim) <= limit


def _operands(dtype, precision):
    return f"float32-{precision}" if dtype == torch.float32 else str(dtype).split(".")[-1]


def choose(dim, dtype, interpret, arch=90, precision="tf32", family="bce"):
    """The `KernelConfig` of width `dim`, operand `dtype`, compute capability `arch`, fp32 `precision`.

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
        settings = _FULL_FP32[(generation, key[0])]
    elif arch < 90 and key in _BEFORE_SM90:
        settings = _BEFORE_SM90[key]
    else:
        settings = _TABLE[key]
    if dtype == torch.float16 and (generation, key[0]) in _FLOAT16_COLUMNS:
        settings = settings._replace(columns_block=_FLOAT16_COLUMNS[(generation, key[0])])
    replace = _REPLACE.get((family, generation, key[0], _operands(dtype, precision)), {})
    return settings._replace(**{f"{kernel}_block": tiles for kernel, tiles in replace.items()})


# `torch.compile` reads it once when it traces (Dynamo folds `get_device_properties`, not this).
@torch.compiler.assume_constant_result
def device_arch(device):
    """The compute capability of a CUDA `device` as an int (90 for 9.0); 90 elsewhere."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def programs_per_sm(registers, num_warps, shared_bytes, arch):
    """How many programs of a compiled kernel one SM holds at once, by its registers, warps and shared memory.

    Registers are allocated per warp in units of 256.

    >>> programs_per_sm(241, 8, 32768, 90), programs_per_sm(227, 4, 40960, 80), programs_per_sm(32, 8, 0, 89)
    (1, 2, 6)
    """
    per_warp = -(-registers * 32 // 256) * 256
    by_shared = _SM_SHARED.get(arch, _SM_SHARED[80]) // (shared_bytes + 1024)
    warps = _SM_FEWER_WARPS.get(arch, _SM_WARPS)
    return max(1, min(_SM_REGISTERS // (per_warp * num_warps), warps // num_warps, by_shared,
                      _SM_PROGRAMS))


def num_splits(num_rows, num_tiles, block_rows, device, programs=1):
    """How many vocabulary splits `rows_kernel` runs: the most whose grid fits one wave (`programs` an SM), >= 1.

    >>> num_splits(4096, 13688, 128, torch.device("cpu"), programs=1)  # 32 row blocks, 6 SMs: 1 split
    1
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = _INTERPRET_SMS
    row_blocks = -(-num_rows // block_rows)
    return max(1, min(num_tiles, programs * sms // row_blocks))
