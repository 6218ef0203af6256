"""The platform and TPU a JAX program is compiled for: routing follows it, not the host.

`compiled_platform()` is None when only the lowering knows (a CPU host with
the TPU compiler): `by_platform` then traces both branches.
"""

import importlib.util
import os
from typing import NamedTuple

import jax

MiB = 2**20
# The smallest VMEM of current TPUs (v4: 16 MiB a TensorCore): a budget
# within it compiles for any generation.
SAFE_VMEM_BYTES = 16 * MiB

# device_kind -> (VMEM bytes per TensorCore, TensorCores a device uses, whether
# float32 division is the reciprocal op alone). Values as in
# `jax._src.pallas.mosaic.tpu_info` (JAX 0.10) and the TPU docs; v4 and v5p are
# megacore chips: one device drives two TensorCores. Division as libtpu compiles
# it (docs/tpu.md): on v6e one `vrcp`; before, `vrcp`, one Newton step and the
# IEEE special cases.
_CHIPS = {
    "TPU v4": (16 * MiB, 2, False),
    "TPU v4 lite": (16 * MiB, 1, False),
    "TPU v5 lite": (128 * MiB, 1, False),
    "TPU v5e": (128 * MiB, 1, False),
    "TPU v5": (64 * MiB, 2, False),
    "TPU v5p": (64 * MiB, 2, False),
    "TPU v6 lite": (128 * MiB, 1, True),
    "TPU v6e": (128 * MiB, 1, True),
}


class ChipInfo(NamedTuple):
    """What the kernels' tiling needs to know about a TPU generation."""

    device_kind: str
    vmem_bytes: int
    cores: int
    reciprocal_divides: bool  # float32 division compiles to the reciprocal op alone


def chip_info(device_kind):
    """Returns the `ChipInfo` of a device kind, or None for an unknown kind."""
    found = _CHIPS.get(str(device_kind))
    return None if found is None else ChipInfo(str(device_kind), *found)


def _mesh_device():
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    return getattr(mesh, "abstract_device", None)


def _context_device():
    device = _mesh_device()
    if device is not None:
        return device.platform, device.device_kind
    default = jax.config.jax_default_device
    if default is not None and not isinstance(default, str):
        return default.platform, default.device_kind
    host = jax.devices()[0]
    if host.platform == "tpu":
        return host.platform, host.device_kind
    return None


def tpu_compiler_available():
    """Returns whether this process could compile for a TPU it does not run on (libtpu)."""
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms and "tpu" not in platforms.split(","):
        return False
    return importlib.util.find_spec("libtpu") is not None


def compiled_platform():
    """Returns `"tpu"`, the host's platform, or None: decide at lowering (see the module)."""
    found = _context_device()
    if found is not None:
        return found[0]
    if tpu_compiler_available():
        return None
    return jax.devices()[0].platform


def compiled_chip():
    """Returns the `ChipInfo` of the TPU the trace is compiled for (None: unknown, not a TPU)."""
    found = _context_device()
    if found is None or found[0] != "tpu":
        return None
    return chip_info(found[1])


def by_platform(operands, tpu, other):
    """`tpu(*operands)` when compiled for a TPU, else `other(*operands)` (both traced when unknown)."""
    platform = compiled_platform()
    if platform == "tpu":
        return tpu(*operands)
    if platform is not None:
        return other(*operands)
    return jax.lax.platform_dependent(*operands, tpu=tpu, default=other)
