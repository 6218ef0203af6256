"""`shard_map` plumbing shared by the sharded loss and retrieval."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_cutbce.common import EMPTY_ID


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` (or the experimental one); every collective is explicit, so no checks."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    from jax.experimental.shard_map import shard_map  # pragma: no cover

    return shard_map(  # pragma: no cover
        fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False
    )


def shard_layout(sharding, vocab, num_rows):
    """Returns `(local, pad, row_axes, rows_per_device)` of a table split along V."""
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
    """Runs `fn` under shard_map, resharding the inputs first on an explicit mesh."""
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
    """Returns this shard's ids moved to `[0, local)`, every other id `EMPTY_ID`."""
    ids = ids.astype(jnp.int32) if ids.dtype.itemsize < 8 else ids
    inside = (ids >= offset) & (ids < offset + local) & (ids < vocab)
    return jnp.where(inside, ids - offset, EMPTY_ID)
