"""Every loss family with the item table split along V (`registry`'s contract, `sharding=`).

One program for any family (the protocol: docs/development.md): each shard
runs the family's pass over its rows (`kernel`: the chunked loop's
`dense_pass` and `sparse_terms`, or Pallas when compiled for a TPU); the
rows' `acc` and positive sums of every shard are all-gathered and folded in
shard order with `merge` (the same numbers on every shard), `finish` gives
the loss; the gradient pass gets the merged `statistics`. Table gradients
stay sharded. A padded row is a zero row with bias `-inf`: no family's tiles
count it.
"""

import functools
from math import log
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_cutbce.backends.jax import chunked, math, pallas, vjp
from keras_cutbce.backends.jax.sharded import mesh as mesh_lib
from keras_cutbce.backends.jax.sharded.discovery import VocabSharding
from keras_cutbce.common import EMPTY_ID
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import default_chunk_size

KERNELS = ("auto", "chunked", "pallas")


def cut_bce(hidden, table, ids, bias=None, *, sharding, label_smoothing=0.0, pos_weight=1.0,
            chunk_size=None, kernel="auto"):
    """Per-row CutBCE `[M]` over the shards; `kernel`: `"auto"`, `"chunked"` or `"pallas"`."""
    family = math.BCE(bce_coefficients(label_smoothing, pos_weight))
    pallas_pass = (_pallas_bce, (float(label_smoothing), float(pos_weight)))
    return _run(family, pallas_pass, hidden, table, ids, bias, sharding, chunk_size, kernel)


def cut_softmax(hidden, table, ids, bias=None, *, sharding, label_smoothing=0.0, chunk_size=None,
                kernel="auto"):
    """Per-row softmax cross-entropy `[M]` over the shards (a log-sum-exp merged over them)."""
    # The smoothing's `-(a / V) sum_v z_v` in closed form: a padded row's -inf is not summed.
    family = math.Softmax(float(label_smoothing), int(table.shape[0]), closed_form=True)
    return _run(family, (_pallas_softmax, ()), hidden, table, ids, bias, sharding, chunk_size, kernel)


def _run(family, pallas_pass, hidden, table, ids, bias, sharding, chunk_size, kernel):
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {KERNELS}. Received: kernel={kernel!r}")
    program = _loss_program(
        VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)), family, pallas_pass,
        int(table.shape[0]), int(hidden.shape[0]), bias is not None,
        None if chunk_size is None else int(chunk_size), kernel)
    return program(hidden, table, jnp.asarray(ids), bias)


class ShardTargets(NamedTuple):
    """One shard's view of the rows' ids (inside `shard_map`)."""

    index: object  # [M, L] the valid distinct ids moved to the shard (0 elsewhere)
    here: object  # [M, L] those on this shard
    keep: object  # [M, L] every valid distinct id, on any shard
    masked: object  # [M, L] `index` where `here`, else EMPTY_ID: the ids a kernel masks
    valid: object  # [local] the shard's real (unpadded) rows; None: all

    def real_bias(self, bias):
        """`bias` with 0 at the padded rows (their `-inf` summed by no closed form)."""
        return bias if self.valid is None or bias is None else jnp.where(self.valid, bias, 0.0)


@functools.lru_cache(maxsize=64)
def _loss_program(sharding, family, pallas_pass, vocab, num_rows, has_bias, chunk_size, kernel):
    """Returns the jitted, cached `(hidden, table, ids, bias) -> [M]` of `family` over the shards."""
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    local, pad, rows, rows_per_device = mesh_lib.shard_layout(sharding, vocab, num_rows)
    pallas_tile = chunk_size  # None: the Pallas kernel's own tile rule
    if chunk_size is None:
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    shard_pass = _shard_pass(kernel, family, pallas_pass, max(1, min(chunk_size, local)),
                             pallas_tile, has_bias)
    with_bias = has_bias or pad > 0  # a padded row needs its -inf bias

    def targets_of(i):
        offset = mesh_lib.shard_offset(vocab_axes, local)
        safe, keep = distinct_targets(i, vocab)
        here = keep & (safe >= offset) & (safe < offset + local)
        index = jnp.where(here, safe - offset, 0)
        valid = jnp.arange(local) + offset < vocab if pad else None
        return ShardTargets(index, here, keep, jnp.where(here, index, EMPTY_ID), valid)

    def merged(h, t, i, b):
        """Every shard's `(acc, positive_rows)` folded in shard order (the same on each shard)."""
        acc, positive_rows, _ = shard_pass(h, t, b, targets_of(i), None, loss=True)
        parts = jax.lax.all_gather((acc, positive_rows), vocab_axes)
        acc, positive_rows = _shard_part(parts, 0)
        for shard in range(1, sharding.num_shards):
            part_acc, part_rows = _shard_part(parts, shard)
            acc = family.merge(acc, part_acc)
            positive_rows = None if positive_rows is None else positive_rows + part_rows
        return acc, positive_rows

    def forward(h, t, i, b):
        acc, positive_rows = merged(h, t, i, b)
        return family.finish(acc, positive_rows, targets_of(i).keep, vocab)

    def backward(h, t, i, b, row_weights):
        targets = targets_of(i)
        stats = family.statistics(merged(h, t, i, b)[0]) if family.two_pass else None
        row_scale, positive_scale = family.row_scale(row_weights, targets.keep, vocab)
        _, _, (grad_h, grad_t, grad_b) = shard_pass(
            h, t, b, targets, stats, loss=False, row_scale=row_scale, positive_scale=positive_scale)
        # One psum over V for the hidden states; table and bias gradients
        # stay sharded along V, summed over the rows' (data) axes only.
        grad_h = jax.lax.psum(grad_h, vocab_axes)
        if rows:
            grad_t = jax.lax.psum(grad_t, rows)
            grad_b = None if b is None else jax.lax.psum(grad_b, rows)
        return grad_h, grad_t, grad_b

    def padded(t, b):
        if with_bias and b is None:
            b = jnp.zeros((vocab,), jnp.float32)
        b = None if b is None else mesh_lib.pad_rows(b, pad, -jnp.inf)
        return mesh_lib.pad_rows(t, pad), b

    row_spec, vocab_spec = mesh_lib.spec(rows, None), P(vocab_axes, None)
    in_specs = [row_spec, vocab_spec, row_spec, P(vocab_axes) if with_bias else None]
    return jax.jit(_per_row_loss(mesh, rows, vocab, pad, in_specs, forward, backward, padded))


def _shard_part(parts, shard):
    """One shard's part of all-gathered `parts`."""
    return jax.tree.map(lambda x: x[shard], parts)


def _per_row_loss(mesh, rows, vocab, pad, in_specs, forward, backward, padded):
    """The shard-mapped `forward` / `backward` of a sharded program as one per-row loss (`vjp.per_row_loss`).

    `padded(t, b)` pads the table (and bias) to the shards; the gradients drop the padded rows.
    """
    row_spec, vocab_spec, _, bias_spec = in_specs

    def unpadded(x):
        """Drops the padded rows of a V-sharded gradient."""
        if not pad or x is None:
            return x
        if mesh_lib.explicit(mesh):  # a sharded dim cannot be sliced unevenly
            x = jax.reshard(x, NamedSharding(mesh, P()))
        return x[:vocab]

    def loss_fn(h, t, i, b):
        t, b = padded(t, b)
        return mesh_lib.shard_mapped(forward, mesh, in_specs, mesh_lib.spec(rows), [h, t, i, b])

    def grads_fn(h, t, i, b, row_scale):
        t, b_padded = padded(t, b)
        grads = mesh_lib.shard_mapped(
            backward, mesh, in_specs + [mesh_lib.spec(rows)], (row_spec, vocab_spec, bias_spec),
            [h, t, i, b_padded, row_scale])
        return grads[0], unpadded(grads[1]), None if b is None else unpadded(grads[2])

    return vjp.per_row_loss(loss_fn, grads_fn)


# -- One shard's pass: `(h, t, b, targets, stats, *, loss, row_scale=None, positive_scale=None)
# -> (acc | None, positive_rows | None, float32 grads | None)` over the shard's rows. --------


def _shard_pass(kernel, family, pallas_pass, tile, pallas_tile, has_bias):
    """The chunked pass, or the family's Pallas pass where compiled for a TPU (`kernel="auto"`)."""
    xla = functools.partial(_chunked_pass, family=family, tile=tile)
    if kernel == "chunked":
        return xla
    make, settings = pallas_pass  # hashable: the program's cache key
    default = make(family, settings, pallas_tile, has_bias, True) if kernel == "pallas" else xla
    tpu = make(family, settings, pallas_tile, has_bias, False)

    def run(*args, **options):
        return jax.lax.platform_dependent(*args, tpu=functools.partial(tpu, **options),
                                          default=functools.partial(default, **options))

    return run


def _chunked_pass(h, t, b, targets, stats, *, family, tile, loss, row_scale=None,
                  positive_scale=None):
    """The chunked loop's tiles, then its sparse terms (the positives weighed by every shard's)."""
    acc, grads = chunked.dense_pass(h, t, b, targets.masked, tile, family, stats, loss=loss,
                                    row_scale=row_scale)
    positive_rows, grads = chunked.sparse_terms(
        h, t, targets.real_bias(b), targets.index, targets.here, family, grads, loss=loss,
        row_scale=positive_scale, counted=targets.keep)
    return acc, positive_rows, grads


def _pallas_bce(family, settings, tile, has_bias, interpret):
    """BCE's Pallas pass: the kernel's sums hold the positives; a padded row is a zero logit's term."""
    label_smoothing, pos_weight = settings
    zero_logit = family.coef.neg_scale * log(2.0)

    def run(h, t, b, targets, stats, *, loss, row_scale=None, positive_scale=None):
        def total(h, t, b):
            b = targets.real_bias(b) if has_bias else None
            rows = t.shape[0] * pallas.cut_bce(
                h, t, targets.masked, b, label_smoothing=label_smoothing, pos_weight=pos_weight,
                chunk_size=tile, interpret=interpret)
            return rows if targets.valid is None else rows - jnp.sum(~targets.valid) * zero_logit

        acc, pullback = jax.vjp(total, h, t, b)
        grads = None
        if row_scale is not None:
            grads = tuple(None if g is None else g.astype(jnp.float32) for g in pullback(row_scale))
        positive_rows = None if targets.index.shape[-1] == 0 else jnp.zeros_like(acc)  # in `acc`
        return (acc if loss else None), (positive_rows if loss else None), grads

    return run


def _pallas_softmax(family, settings, tile, has_bias, interpret):
    """Softmax's Pallas pass: its statistics and gradient kernels, then `sparse_terms`."""
    options = dict(chunk_size=tile, interpret=interpret)

    def run(h, t, b, targets, stats, *, loss, row_scale=None, positive_scale=None):
        acc = grads = None
        if loss:
            m, s = pallas.softmax_statistics(h, t, b, **options)
            acc = (m, s, jnp.zeros_like(m))  # the smoothing's sum is `family.linear`'s
        if row_scale is not None:
            # The positives' rows first (the same gather `sparse_terms` makes): the row-major copy of the
            # shard they come from is then freed before the kernel's gradient of the shard exists.
            rows = jnp.take(t, targets.index, axis=0)
            h, rows = jax.lax.optimization_barrier((h, rows))
            grads = pallas.softmax_gradients(h, t, b, stats, row_scale, **options)
        positive_rows, grads = chunked.sparse_terms(
            h, t, targets.real_bias(b), targets.index, targets.here, family, grads, loss=loss,
            row_scale=positive_scale, counted=targets.keep)
        return acc, positive_rows, grads

    return run
