"""Choose the kernel that runs an op: the registry's table applied to a backend, a device and a table.

A table split along V over a JAX mesh runs `"sharded"` under `"auto"` and
`"chunked"` (read from the table's variable, so a traced value inside a
compiled step is routed too); `"auto"` otherwise runs the first
implementation of `registry.AUTO_ORDER` for the platform the program is
compiled for (on JAX with the TPU compiler and no known platform, both are
traced and the lowering keeps the platform's: `backends.jax.compile_platform`);
on torch, for the device of the hidden states (CUDA tensors: `"triton"`
when Triton is installed, else `"chunked"`). `chunk_size=None` resolves
with `math.tiling.default_chunk_size` for the chunked kernels (Pallas,
Triton and the sharded path choose their own tiles). The
inputs are checked by the public ops before they get here.
"""

import math

import keras

from keras_cutbce import checks
from keras_cutbce import registry
from keras_cutbce.item_table import ItemTable
from keras_cutbce.math.tiling import default_chunk_size
from keras_cutbce.math.tiling import max_tile
from keras_cutbce.math.tiling import tile_budget_bytes

__all__ = ["dispatch", "select_implementation"]


def _platform(tensor):
    """Returns "cpu", "gpu", "tpu", ... where the active backend runs `tensor`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "torch":
        return "gpu" if tensor.device.type == "cuda" else tensor.device.type
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _default_chunk_size(hidden, table):
    lead = checks.static_dims(hidden)[:-1]
    rows = None if None in lead else int(math.prod(lead))
    vocab, dim = checks.static_dims(table)
    vocab = vocab or 2**20
    backend, platform = keras.backend.backend(), _platform(hidden)
    budget = tile_budget_bytes(backend, platform, table_bytes=4 * vocab * (dim or 0))
    return default_chunk_size(rows or 4096, vocab, budget, max_tile(backend, platform))


def _compiled_platform(backend):
    """Returns the platform the program is compiled for; None on JAX when decided at lowering."""
    if backend != "jax":
        return None
    from keras_cutbce.backends.jax import compile_platform

    return compile_platform.compiled_platform()


def select_implementation(implementation="auto"):
    """Returns the implementation `"auto"` resolves to on this backend and target.

    On JAX, `"pallas"` when the program is compiled for a TPU (known at trace
    time: a TPU host, a TPU mesh or `jax.default_device`), else `"chunked"`.
    When the target is only known at lowering (a CPU host with the TPU
    compiler), the ops compile both and keep the target's
    (`keras_cutbce.backends.jax.compile_platform`); this function then answers for
    the host.

    Args:
        implementation: a value of `implementation=`; any but `"auto"` is
            returned as it is.

    Returns:
        The implementation's name.

    Example:

    >>> select_implementation("reference")
    'reference'
    """
    checks.check_implementation(implementation)
    if implementation != "auto":
        return implementation
    backend = keras.backend.backend()
    return registry.auto("cut_bce", backend, _compiled_platform(backend))


def dispatch(op, implementation, hidden, table, *args, chunk_size, **kwargs):
    """Runs `op` on checked 2-D inputs; `table` is an `ItemTable`.

    Returns None when the chosen implementation has no such op (only
    `cut_bce_weighted_sum`, which the caller then reduces from `cut_bce`).
    """
    backend = keras.backend.backend()
    if implementation in ("auto", "chunked") and table.sharding is not None:
        route = "sharded"
    elif implementation == "auto":
        # On torch the tensors' device decides (CUDA: the Triton kernels).
        platform = _platform(hidden) if backend == "torch" else _compiled_platform(backend)
        tpu, other = registry.auto(op, backend, "tpu"), registry.auto(op, backend, platform)
        if platform is None and tpu != other:
            from keras_cutbce.backends.jax import compile_platform

            def run(route):
                return lambda h, t, *a: dispatch(op, route, h, ItemTable(t, sharding=None),
                                                   *a, chunk_size=chunk_size, **kwargs)

            return compile_platform.by_platform((hidden, table.value) + args, run(tpu), run(other))
        route = other
    else:
        route = implementation
    if not registry.has(op, route, backend):
        return None
    kernel = registry.get(op, route, backend)
    if route == "reference":
        return kernel(hidden, table.value, *args, **kwargs)
    if route == "sharded":
        kwargs["sharding"] = table.sharding
        if op == "cut_bce" and implementation == "chunked":
            kwargs["kernel"] = "chunked"  # forced: the XLA loop on every shard, TPU included
    elif route == "chunked" and chunk_size is None:
        chunk_size = _default_chunk_size(hidden, table.value)
    return kernel(hidden, table.value, *args, chunk_size=chunk_size, **kwargs)
