"""`shard_map` plumbing shared by the sharded loss and retrieval.

Rows are split over the mesh axes that do not split V (data parallelism)
when their number divides the row count, otherwise replicated. V not
divisible by the shard count is handled by padding the table with zero rows
to a multiple (each caller says what a padded row contributes).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_cutbce.common import EMPTY_ID


def _shard_map(fn, mesh, in_specs, out_specs):
    """Returns `jax.shard_map` (jax >= 0.7), or `jax.experimental.shard_map` before it.

    Replication checking is off: the single-device kernels start their loop
    carries from constants, and every collective here is explicit (the
    gradients come from our own `custom_vjp`, not from JAX transposing
    collectives), so the out specs are right by construction.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    from jax.experimental.shard_map import shard_map  # pragma: no cover

    return shard_map(  # pragma: no cover
        fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False
    )


def shard_layout(sharding, vocab, num_rows):
    """Returns `(local, pad, row_axes, rows_per_device)` of a table split along V.

    `local`: items per shard; `pad`: zero rows added to the table;
    `row_axes`: the mesh axes (not on V) the rows are split over, () when
    they do not divide `num_rows`.
    """
    mesh = sharding.mesh
    local = -(-vocab // sharding.num_shards)
    pad = local * sharding.num_shards - vocab
    axes = tuple(
        a for a in mesh.axis_names if a not in sharding.vocab_axes and mesh.shape[a] > 1
    )
    size = math.prod(mesh.shape[a] for a in axes)
    row_axes = axes if axes and num_rows % size == 0 else ()
    rows_per_device = num_rows // math.prod(mesh.shape[a] for a in row_axes)
    return local, pad, row_axes, rows_per_device


def pad_rows(x, rows, value=0):
    """Returns `x` with `rows` more rows of `value` (the padded shard rows)."""
    if rows == 0:
        return x
    widths = [(0, rows)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


def spec(axes, *rest):
    """Returns the `PartitionSpec` of an array split on dimension 0 over `axes` (or not)."""
    return P(axes if axes else None, *rest)


def explicit(mesh):
    """Returns whether `mesh` has explicit axes (sharding-in-types)."""
    axis_type = getattr(jax.sharding.AxisType, "Explicit", None)
    return axis_type is not None and axis_type in tuple(getattr(mesh, "axis_types", ()))


def shard_mapped(fn, mesh, in_specs, out_specs, args):
    """Runs `fn` under shard_map; on a mesh with explicit axes, reshards the inputs first.

    (On automatic axes shard_map reshards its inputs itself; with explicit
    sharding-in-types it requires them to match the specs already.)
    """
    if explicit(mesh):
        args = [
            x if x is None else jax.reshard(x, NamedSharding(mesh, s))
            for x, s in zip(args, in_specs)
        ]
    return _shard_map(fn, mesh, tuple(in_specs), out_specs)(*args)


def shard_offset(vocab_axes, local):
    """Returns the first global id of this device's shard (inside `shard_map`)."""
    return jax.lax.axis_index(vocab_axes) * local


def rebase(ids, offset, local, vocab):
    """Returns the ids of this shard moved to `[0, local)`; every other id becomes `EMPTY_ID`.

    The padded rows of the last shard (ids `>= vocab`) are never items.
    """
    ids = ids.astype(jnp.int32) if ids.dtype.itemsize < 8 else ids
    inside = (ids >= offset) & (ids < offset + local) & (ids < vocab)
    return jnp.where(inside, ids - offset, EMPTY_ID)
