"""Compile for a TPU that is not there, and read what the compiler decided.

A helper of the TPU compile tests (`tests/tpu_compile_child.py`) and the
TPU benchmarks (`tools/cutbce_tpu.py`, `tools/pallas_traffic.py`),
not part of the package.

With `libtpu` installed (`pip install "keras-cutbce-erase[tpu-compile]"`),
`jax.experimental.topologies` gives deviceless TPU devices; a function jitted
on `jax.ShapeDtypeStruct` arguments placed on one of them is compiled by the
real Mosaic and XLA:TPU compilers on any host. Nothing runs (no timing), but
HBM temporaries, VMEM, layouts and lowering are the ones a TPU would get.

- `topology_devices(name)`: the devices of a topology such as `"v6e:2x2"`,
  `"v5e:2x2"`, `"v5p:2x2x1"`, `"v4:2x2x1"`.
- `compile_report(fn, args, target=None)`: compiles `fn(*args)` (under
  `jax.set_mesh` of `target`'s device, so the kernels' tiling knows the
  generation; `target=None` leaves it unknown) and returns a `CompileReport`.

Example (skipped without libtpu):

>>> import jax, jax.numpy as jnp
>>> dev = topology_devices("v6e:2x2")[0]  # doctest: +SKIP
>>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
...                          sharding=jax.sharding.SingleDeviceSharding(dev))  # doctest: +SKIP
>>> compile_report(lambda x: x * 2, (x,)).temp_bytes  # doctest: +SKIP
0
"""

import base64
import functools
import json
import os
import re
from typing import NamedTuple

import jax


class Kernel(NamedTuple):
    """One Mosaic kernel of a compiled program."""

    name: str
    scoped_vmem_bytes: int  # `used_scoped_memory_configs`, summed
    vmem_limit_bytes: int  # the `vmem_limit_bytes` it asked for, 0 for the default
    parallel_axis: bool  # its Mosaic module has a "parallel" grid axis (megacore: split across cores)
    output_shapes: tuple  # e.g. ("f32[2,1,2048]", ...): per-core partials lead with the core count


class CompileReport(NamedTuple):
    """What the TPU compiler produced for one program."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    kernels: tuple  # of `Kernel`
    custom_call_targets: tuple  # every custom-call target, sorted, unique

    @property
    def host_callbacks(self):
        """Whether the program calls back into Python (e.g. the Pallas interpreter)."""
        return any("callback" in target for target in self.custom_call_targets)


@functools.lru_cache(maxsize=None)
def topology_devices(name):
    """The deviceless devices of a TPU topology (needs `libtpu`)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*custom_call_target=\"([^\"]+)\"")


def _config_bytes(key, line):
    """Sum of the `size`s of a `"key":[...]` list of a backend config (0 if absent)."""
    found = re.search('"' + key + r'":\[([^\]]*)\]', line)
    return sum(map(int, re.findall(r'"size":"(\d+)"', found.group(1)))) if found else 0


def _has_parallel_axis(line):
    """Whether the kernel's Mosaic module (base64 MLIR bytecode) names a parallel grid axis."""
    found = re.search(r'"body":"([A-Za-z0-9+/=]+)"', line)
    return bool(found) and b"dimension_semantics<parallel>" in base64.b64decode(found.group(1))


def _output_shapes(line):
    """The shapes of a custom call's result (one, or a tuple)."""
    found = re.match(r"^[^=]*=(.*?)\scustom-call\(", line)
    if found is None:
        return ()
    return tuple(re.findall(r"\b[a-z]+\d*\[[\d,]*\]", found.group(1)))


def _kernel(name, line):
    # "scoped_memory_configs" holds the kernel's `vmem_limit_bytes` when it asked for one.
    return Kernel(name.split(".")[0], _config_bytes("used_scoped_memory_configs", line),
                  _config_bytes("scoped_memory_configs", line), _has_parallel_axis(line),
                  _output_shapes(line))


def parse_hlo(text):
    """`(kernels, custom_call_targets)` of a compiled HLO module's text."""
    kernels, targets = [], set()
    for line in text.splitlines():
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        name, target = found.groups()
        targets.add(target)
        if target == "tpu_custom_call":
            kernels.append(_kernel(name, line))
    return tuple(kernels), tuple(sorted(targets))


def compile_report(fn, args, target=None):
    """Compiles `jax.jit(fn)(*args)` and returns its `CompileReport`.

    Args:
        fn: the function to compile.
        args: `jax.ShapeDtypeStruct`s (with TPU shardings) or arrays.
        target: a TPU device whose generation the trace may know (through
            `jax.set_mesh`), or None: the generation stays unknown.
    """
    if target is None:
        compiled = jax.jit(fn).lower(*args).compile()
    else:
        with jax.set_mesh(jax.sharding.Mesh([target], ("cutbce_target",))):
            compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    kernels, targets = parse_hlo(compiled.as_text())
    return CompileReport(
        int(memory.temp_size_in_bytes), int(memory.argument_size_in_bytes),
        int(memory.output_size_in_bytes), kernels, targets,
    )


def report_json(report):
    """The report as a JSON string."""
    data = report._asdict()
    data["kernels"] = [k._asdict() for k in report.kernels]
    data["host_callbacks"] = report.host_callbacks
    return json.dumps(data)
