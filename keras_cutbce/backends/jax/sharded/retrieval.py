"""Top-k (one `all_gather` of candidates) and rank counts (one `psum`) with the table split along V."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from keras_cutbce.backends.jax import chunked, retrieval
from keras_cutbce.backends.jax.sharded import mesh as mesh_lib
from keras_cutbce.backends.jax.sharded.discovery import VocabSharding
from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.tiling import default_chunk_size


def _merge(scores, ids, k):
    """Returns the top-k of candidates `[M, C]`: score descending, then lower id first."""
    key = jnp.where(ids < 0, jnp.iinfo(jnp.int32).max, ids)
    neg, key = jax.lax.sort((-scores, key), dimension=1, num_keys=2)
    scores, ids = -neg[:, :k], key[:, :k]
    return scores, jnp.where(scores == -jnp.inf, EMPTY_ID, ids)


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, sharding, chunk_size=None):
    """Returns the exact top-k `(scores, ids)` per row over the shards (`registry`'s contract)."""
    program = _retrieval_program(
        "top_k", VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)),
        int(table.shape[0]), int(hidden.shape[0]), bias is not None,
        exclude_ids is not None, int(k), None if chunk_size is None else int(chunk_size),
    )
    return program(hidden, table, bias, None if exclude_ids is None else jnp.asarray(exclude_ids))


def count_above(hidden, table, bias, scores, ids, exclude_ids=None, *, sharding,
                chunk_size=None):
    """Counts per row the items ranked above `(scores, ids)` over the shards (`registry`'s contract)."""
    program = _retrieval_program(
        "count_above", VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)),
        int(table.shape[0]), int(hidden.shape[0]), bias is not None,
        exclude_ids is not None, None, None if chunk_size is None else int(chunk_size),
    )
    exclude_ids = None if exclude_ids is None else jnp.asarray(exclude_ids)
    return program(hidden, table, bias, exclude_ids, jnp.asarray(scores, jnp.float32),
                   jnp.asarray(ids, jnp.int32))


@functools.lru_cache(maxsize=64)
def _retrieval_program(kind, sharding, vocab, num_rows, has_bias, has_exclude, arg, chunk_size):
    """Returns the jitted, cached sharded `top_k` (`arg` = k) or `count_above`."""
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    local, pad, rows, rows_per_device = mesh_lib.shard_layout(sharding, vocab, num_rows)
    if chunk_size is None:
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    with_bias = has_bias or pad > 0

    def shard_top_k(h, t, x=None, b=None):
        offset = mesh_lib.shard_offset(vocab_axes, local)
        x = None if x is None else mesh_lib.rebase(x, offset, local, vocab)
        scores, ids = retrieval.top_k(h, t, min(arg, local), b, x, chunk_size=chunk_size)
        ids = jnp.where(ids < 0, ids, ids + offset)
        scores = jax.lax.all_gather(scores, vocab_axes, axis=1, tiled=True)
        ids = jax.lax.all_gather(ids, vocab_axes, axis=1, tiled=True)
        nan_rows = jnp.any(jnp.isnan(scores), axis=1, keepdims=True)  # NaN on some shard
        scores, ids = _merge(jnp.where(nan_rows, -jnp.inf, scores), ids, arg)
        return jnp.where(nan_rows, jnp.nan, scores), jnp.where(nan_rows, EMPTY_ID, ids)

    def shard_count(h, t, x=None, b=None, s=None, i=None):
        offset = mesh_lib.shard_offset(vocab_axes, local)
        x = None if x is None else mesh_lib.rebase(x, offset, local, vocab)
        # Local columns against global ids: column c is item c + offset.
        counts, nan_rows = retrieval.count_above_parts(h, t, b, s, i - offset, x,
                                                       chunk_size=chunk_size)
        nan_rows = jax.lax.psum(nan_rows.astype(jnp.int32), vocab_axes) > 0
        return jnp.where(nan_rows, -1, jax.lax.psum(counts, vocab_axes))

    in_specs = [
        mesh_lib.spec(rows, None),
        P(vocab_axes, None),
        mesh_lib.spec(rows, None) if has_exclude else None,
        P(vocab_axes) if with_bias else None,
    ]
    out = mesh_lib.spec(rows, None)
    if kind == "top_k":
        fn, out_specs = shard_top_k, (out, out)
    else:
        fn, out_specs = shard_count, mesh_lib.spec(rows)
        in_specs += [mesh_lib.spec(rows), mesh_lib.spec(rows)]

    @jax.jit
    def program(hidden, table, bias, exclude_ids, *row_args):
        if with_bias:
            # Padded rows get a -inf logit and ids >= V: never a candidate, never counted.
            bias = jnp.zeros((vocab,), jnp.float32) if bias is None else bias
            bias = mesh_lib.pad_rows(bias, pad, -jnp.inf)
            table = mesh_lib.pad_rows(table, pad)
        return mesh_lib.shard_mapped(fn, mesh, in_specs, out_specs,
                                     [hidden, table, exclude_ids, bias, *row_args])

    return program
