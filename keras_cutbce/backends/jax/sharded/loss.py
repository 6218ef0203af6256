"""Both loss families with the item table split along V (`registry`'s contract, `sharding=`).

BCE: one `psum` of the shards' sums. Softmax: a global log-sum-exp (`pmax`,
`psum` of rescaled sums). Table gradients stay sharded. Per-shard kernel
`"auto"`: Pallas when compiled for a TPU, else chunked. A padded table row
is a zero row (BCE: its constant term subtracted; softmax: bias `-inf`).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_cutbce.backends.jax import chunked, pallas, vjp
from keras_cutbce.backends.jax.math import Softmax
from keras_cutbce.backends.jax.sharded import mesh as mesh_lib
from keras_cutbce.backends.jax.sharded.discovery import VocabSharding
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.math.positives import distinct_targets
from keras_cutbce.math.tiling import default_chunk_size

KERNELS = ("auto", "chunked", "pallas")


def _shard_kernel(kernel, label_smoothing, pos_weight, chunk_size, pallas_tile):
    """Returns `(h, t, ids, b) -> [rows]`: one shard's per-row CutBCE on the target platform."""
    settings = dict(label_smoothing=label_smoothing, pos_weight=pos_weight)

    def xla(h, t, i, b):
        return chunked.cut_bce(h, t, i, b, chunk_size=chunk_size, **settings)

    def pallas_kernel(interpret):
        def run(h, t, i, b):
            return pallas.cut_bce(h, t, i, b, chunk_size=pallas_tile, interpret=interpret,
                                  **settings)

        return run

    if kernel == "chunked":
        return xla
    default = pallas_kernel(True) if kernel == "pallas" else xla

    def run(h, t, i, b):
        return jax.lax.platform_dependent(h, t, i, b, tpu=pallas_kernel(False), default=default)

    return run


def cut_bce(
    hidden,
    table,
    ids,
    bias=None,
    *,
    sharding,
    label_smoothing=0.0,
    pos_weight=1.0,
    chunk_size=None,
    kernel="auto",
):
    """Per-row CutBCE `[M]` over the shards; `kernel`: `"auto"`, `"chunked"` or `"pallas"`."""
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {KERNELS}. Received: kernel={kernel!r}")
    program = _loss_program(
        VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)),
        int(table.shape[0]),
        int(hidden.shape[0]),
        bias is not None,
        float(label_smoothing),
        float(pos_weight),
        None if chunk_size is None else int(chunk_size),
        kernel,
    )
    return program(hidden, table, jnp.asarray(ids), bias)


@functools.lru_cache(maxsize=64)
def _loss_program(sharding, vocab, num_rows, has_bias, label_smoothing, pos_weight, chunk_size,
                  kernel="auto"):
    """Returns the jitted, cached `(hidden, table, ids, bias) -> [M]` sharded BCE."""
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    local, pad, rows, rows_per_device = mesh_lib.shard_layout(sharding, vocab, num_rows)
    pallas_tile = chunk_size  # None: the Pallas kernel's own tile rule
    if chunk_size is None:
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    shard_loss = _shard_kernel(kernel, label_smoothing, pos_weight, chunk_size, pallas_tile)

    def shard_sum(h, t, i, b):
        """This shard's `sum_v` of the loss terms, `[rows]`."""
        local_ids = mesh_lib.rebase(i, mesh_lib.shard_offset(vocab_axes, local), local, vocab)
        return shard_loss(h, t, local_ids, b) * local

    row_spec, vocab_spec = mesh_lib.spec(rows, None), P(vocab_axes, None)
    bias_spec = P(vocab_axes) if has_bias else None
    in_specs = [row_spec, vocab_spec, row_spec, bias_spec]

    def forward(h, t, i, b):
        return jax.lax.psum(shard_sum(h, t, i, b), vocab_axes)

    def backward(h, t, i, b, row_scale):
        _, pullback = jax.vjp(lambda h, t, b: shard_sum(h, t, i, b), h, t, b)
        grad_h, grad_t, grad_b = pullback(row_scale)
        # One psum over V for the hidden states; table and bias gradients
        # stay sharded along V, summed over the rows' (data) axes only.
        grad_h = jax.lax.psum(grad_h, vocab_axes)
        if rows:
            grad_t = jax.lax.psum(grad_t, rows)
            grad_b = None if b is None else jax.lax.psum(grad_b, rows)
        return grad_h, grad_t, grad_b

    def padded(t, b):
        return mesh_lib.pad_rows(t, pad), None if b is None else mesh_lib.pad_rows(b, pad)

    total_of = _per_row_loss(mesh, rows, vocab, pad, in_specs, forward, backward, padded)
    neg_scale = bce_coefficients(label_smoothing, pos_weight).neg_scale

    @jax.jit
    def program(hidden, table, ids, bias):
        total = total_of(hidden, table, ids, bias)
        if pad:
            # A zero row with zero bias has logit 0: a constant term per padded row.
            total = total - pad * neg_scale * math.log(2.0)
        return total / vocab

    return program


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


def _softmax_shard_kernels(kernel, tile, pallas_tile):
    """Returns one shard's `statistics(h, t, b)` and `gradients(h, t, b, lse, row_scale)`."""
    family = Softmax(0.0, 1)  # no smoothing: its linear term is the program's own

    def xla_statistics(h, t, b):
        return chunked.dense_pass(h, t, b, None, tile, family, loss=True)[0][:2]

    def xla_gradients(h, t, b, lse, row_scale):
        return chunked.dense_pass(h, t, b, None, tile, family, lse, loss=False,
                                   row_scale=row_scale)[1]

    def pallas_kernels(interpret):
        settings = dict(chunk_size=pallas_tile, interpret=interpret)
        return (lambda h, t, b: pallas.softmax_statistics(h, t, b, **settings),
                lambda h, t, b, lse, s: pallas.softmax_gradients(h, t, b, lse, s, **settings))

    if kernel == "chunked":
        return xla_statistics, xla_gradients
    default = pallas_kernels(True) if kernel == "pallas" else (xla_statistics, xla_gradients)
    tpu = pallas_kernels(False)
    return tuple(
        functools.partial(lambda k, *args: jax.lax.platform_dependent(
            *args, tpu=tpu[k], default=default[k]), k) for k in range(2))


def cut_softmax(hidden, table, ids, bias=None, *, sharding, label_smoothing=0.0, chunk_size=None,
                kernel="auto"):
    """Per-row softmax cross-entropy `[M]` over the shards (a global log-sum-exp)."""
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {KERNELS}. Received: kernel={kernel!r}")
    program = _softmax_program(
        VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)), int(table.shape[0]),
        int(hidden.shape[0]), bias is not None, float(label_smoothing),
        None if chunk_size is None else int(chunk_size), kernel)
    return program(hidden, table, jnp.asarray(ids), bias)


@functools.lru_cache(maxsize=64)
def _softmax_program(sharding, vocab, num_rows, has_bias, label_smoothing, chunk_size, kernel):
    """Returns the jitted `(hidden, table, ids, bias) -> [M]` sharded softmax loss (cached)."""
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    local, pad, rows, rows_per_device = mesh_lib.shard_layout(sharding, vocab, num_rows)
    pallas_tile = chunk_size
    if chunk_size is None:
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    statistics, gradients = _softmax_shard_kernels(kernel, max(1, min(chunk_size, local)),
                                                   pallas_tile)
    positive_weight = -(1.0 - label_smoothing)
    with_bias = has_bias or pad > 0  # a padded row needs its -inf bias

    def lse_of(h, t, b):
        m, s = statistics(h, t, b)
        top = jax.lax.pmax(m, vocab_axes)
        return top + jnp.log(jax.lax.psum(s * jnp.exp(m - top), vocab_axes))

    def positives(h, t, b, i):
        """This shard's part of `-(1 - a) / |P| sum_p z_p` `[rows]`; `|P|` over every shard."""
        _, keep_all = distinct_targets(i, vocab)
        count = jnp.maximum(jnp.sum(keep_all, axis=1), 1).astype(jnp.float32)
        local_ids = mesh_lib.rebase(i, mesh_lib.shard_offset(vocab_axes, local), local, vocab)
        index, keep = distinct_targets(local_ids, local)
        z = jnp.sum(h.astype(jnp.float32)[:, None, :]
                    * jnp.take(t, index, axis=0).astype(jnp.float32), axis=-1)
        if b is not None:
            z = z + jnp.take(b, index, axis=0).astype(jnp.float32)
        return positive_weight * jnp.sum(jnp.where(keep, z, 0.0), axis=1) / count

    def has_target(i):
        return jnp.any(distinct_targets(i, vocab)[1], axis=1)

    row_spec, vocab_spec = mesh_lib.spec(rows, None), P(vocab_axes, None)
    bias_spec = P(vocab_axes) if with_bias else None
    in_specs = [row_spec, vocab_spec, row_spec, bias_spec]

    def forward(h, t, i, b):
        total = lse_of(h, t, b) + jax.lax.psum(positives(h, t, b, i), vocab_axes)
        return jnp.where(has_target(i), total, 0.0)

    def backward(h, t, i, b, row_scale):
        row_scale = jnp.where(has_target(i), row_scale, 0.0)
        grad_h, grad_t, grad_b = gradients(h, t, b, lse_of(h, t, b), row_scale)
        _, pullback = jax.vjp(lambda h, t, b: positives(h, t, b, i), h, t, b)
        more_h, more_t, more_b = pullback(row_scale)
        grad_h = jax.lax.psum(grad_h + more_h, vocab_axes)
        grad_t = grad_t + more_t
        grad_b = None if b is None else grad_b + more_b
        if rows:
            grad_t = jax.lax.psum(grad_t, rows)
            grad_b = None if b is None else jax.lax.psum(grad_b, rows)
        return grad_h, grad_t, grad_b

    def padded(t, b):
        if with_bias and b is None:
            b = jnp.zeros((vocab,), jnp.float32)
        b = None if b is None else mesh_lib.pad_rows(b, pad, -jnp.inf)
        return mesh_lib.pad_rows(t, pad), b

    loss_of = _per_row_loss(mesh, rows, vocab, pad, in_specs, forward, backward, padded)

    @jax.jit
    def program(hidden, table, ids, bias):
        loss = loss_of(hidden, table, ids, bias)
        if label_smoothing:
            total = jnp.dot(hidden.astype(jnp.float32), jnp.sum(table.astype(jnp.float32), axis=0),
                            precision=jax.lax.Precision.HIGHEST)
            if bias is not None:
                total = total + jnp.sum(bias.astype(jnp.float32))
            loss = loss - jnp.where(has_target(ids), (label_smoothing / vocab) * total, 0.0)
        return loss

    return program
