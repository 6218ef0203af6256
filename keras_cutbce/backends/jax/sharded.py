"""CutBCE and top-k with the item table sharded over a JAX mesh axis along V.

When the table `E [V, D]` is split over one or more mesh axes along the
vocabulary (`NamedSharding(mesh, P("model", None))`, or a Keras
`ModelParallel` `LayoutMap` entry `("model", None)`), each device runs the
single-device kernels (`chunked.cut_bce`, `retrieval.top_k`) on its own
shard inside `jax.shard_map`, and one collective combines the results:

- loss: ids are rebased to the shard (`id - offset`; ids of other shards
  become padding), each device computes the sum of its shard's terms (with
  the kernel of the compilation target, see below), and
  one `psum` over the vocabulary axes adds them; the mean uses the global V.
  Differentiating the `psum` makes JAX's transpose add one `psum` for the
  hidden-state gradient, while the table and bias gradients stay sharded:
  no device ever holds the full table or its full gradient.
- top-k: each device takes its shard's top-k with global ids, one
  `all_gather` of the `[rows, k]` candidates over the vocabulary axes, and
  a merge (ties: the lower id, as on one device);
- `count_at_least` (the metrics' false positives): each device counts its
  shard, one `psum` of the `[rows]` counts.

Per-shard loss kernel (`kernel="auto"`): chosen by the platform the program
is compiled for, not the host (`jax.lax.platform_dependent`): a TPU program
runs the Pallas kernels (`pallas_tpu.cut_bce`, compiled by Mosaic, never the
interpreter), any other runs the chunked XLA loop (`chunked.cut_bce`). So an
ahead-of-time compile for a TPU pod from a CPU host (e.g. deviceless
`jax.experimental.topologies` devices) builds the program a TPU host runs;
only the chosen branch is lowered. `kernel="chunked"` forces the XLA loop
everywhere; `kernel="pallas"` forces the Pallas kernels (in the Pallas TPU
interpreter when compiled for a non-TPU platform, which is slow but exact:
for tests). Per-chip HBM of the Pallas path on v6e/v5e pods at 10^7 and
10^8 items: `benchmarks/results/sharded_tpu.md`.

Each public function builds its `shard_map`/`custom_vjp` program once per
configuration (mesh, shapes, settings; `functools.lru_cache`) and jits it,
so eager calls reuse the compiled program instead of rebuilding closures.

Rows are split over the remaining mesh axes (data parallelism) when their
number divides the row count, otherwise replicated.

V not divisible by the number of shards is handled: the table is padded
with zero rows to a multiple. A zero row with zero bias has logit exactly 0,
so its loss term is the constant `neg_scale * log(2)`, subtracted once, and
it adds nothing to the hidden-state gradient; for top-k the padded rows get
a bias of `-inf` and are never returned.

Where the sharding is found (`vocab_sharding_of`, used by
`keras_cutbce.ops` on the JAX backend, so `cut_binary_crossentropy`,
`CutBCELoss` and `cut_top_k` take this path by themselves):

- a Keras variable (or Embedding layer) laid out by the current
  `keras.distribution` (e.g. `ModelParallel` with
  `layout_map["items/embeddings"] = ("model", None)`): works inside the
  traced Keras train step, because the layout belongs to the variable;
- a concrete jax array with a `NamedSharding` that splits dimension 0;
- a traced array on a mesh with explicit axes (`jax.make_mesh`'s default,
  sharding-in-types), under `jit` too.

A traced array on a mesh with automatic axes carries no sharding, so inside
your own `jax.jit` with such a mesh, call `cut_bce`/`top_k` here with an
explicit `VocabSharding(mesh, ("model",))`. Without the sharded path the
result is still right (XLA partitions the single-device kernel), but each
device then gathers the full table gradient (see
`benchmarks/results/sharded_memory.md`).

Keras and JAX cannot create a variable split unevenly, so under
`ModelParallel` choose V (e.g. `num_items + 1`) divisible by the shard count;
a table passed as an array with an explicit `VocabSharding` may have any V.

Example:

```python
mesh = jax.make_mesh((2, 4), ("data", "model"))
table = jax.device_put(table, NamedSharding(mesh, P("model", None)))
spec = vocab_sharding_of(table)            # VocabSharding(mesh, ("model",))
loss = cut_bce(hidden, table, ids, sharding=spec)           # [M]
scores, ids = top_k(hidden, table, 10, sharding=spec)       # [M, 10]
```
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_cutbce.backends.jax import chunked, pallas_tpu, retrieval
from keras_cutbce.math.coefficients import bce_coefficients
from keras_cutbce.common import ids_as_int32
from keras_cutbce.math.tiling import default_chunk_size


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` (jax >= 0.7), or `jax.experimental.shard_map` before it.

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


class VocabSharding(NamedTuple):
    """Where the vocabulary dimension of the item table is split.

    Attributes:
        mesh: the `jax.sharding.Mesh`.
        vocab_axes: tuple of mesh axis names dimension 0 of the table is
            split over (their sizes multiply to the shard count).
    """

    mesh: object
    vocab_axes: tuple

    @property
    def num_shards(self):
        return math.prod(self.mesh.shape[a] for a in self.vocab_axes)


def _from_spec(mesh, spec):
    """`VocabSharding` if `spec` splits dimension 0 over > 1 devices, else None."""
    if mesh is None or spec is None or len(spec) == 0 or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    sharding = VocabSharding(mesh, tuple(axes))
    return sharding if sharding.num_shards > 1 else None


def _keras_layout(variable):
    """The Keras `TensorLayout` (or jax sharding) of a Keras variable, if any."""
    import keras

    layout = None
    distribution = keras.distribution.distribution()
    if distribution is not None:
        layout = distribution.get_variable_layout(variable)
    if layout is None:
        # Set by Keras when the variable was created under a distribution.
        layout = getattr(variable, "_layout", None)
    return layout


def vocab_sharding_of(embeddings):
    """Returns the `VocabSharding` of an item table, or None when it is not split on V.

    Looks, in order, at: a Keras variable's layout (from the current
    `keras.distribution` or the one it was created under; a layer is read
    through its `embeddings` variable), then a concrete jax array's
    `NamedSharding`, then a traced array's sharding type (JAX explicit
    sharding). Inside a traced Keras train step the variable's layout is what
    is observable; a bare traced array under automatic (GSPMD) sharding
    carries no sharding, so call `cut_bce`/`top_k` here with an explicit
    `VocabSharding` in that case.

    Returns None unless dimension 0 is split over more than one device.

    Example:

    >>> import numpy as np
    >>> vocab_sharding_of(np.zeros((10, 4), "float32")) is None
    True
    """
    import keras

    from keras_cutbce.item_table import table_variable

    embeddings = table_variable(embeddings)  # a layer's table variable (LoRA too)
    if isinstance(embeddings, keras.Variable):
        layout = _keras_layout(embeddings)
        if layout is None:
            return None
        if isinstance(layout, NamedSharding):
            return _from_spec(layout.mesh, layout.spec)
        mesh = getattr(layout, "device_mesh", None)
        if mesh is None:
            return None
        return _from_spec(mesh.backend_mesh, tuple(layout.axes))
    if isinstance(embeddings, jax.core.Tracer):
        try:
            sharding = jax.typeof(embeddings).sharding
        except Exception:  # no sharding-in-types on this jax
            return None
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or getattr(mesh, "empty", True):
            return None
        return _from_spec(mesh, getattr(sharding, "spec", None))
    sharding = getattr(embeddings, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return _from_spec(sharding.mesh, sharding.spec)
    return None


def _row_axes(sharding, num_rows):
    """Mesh axes (not on V) the rows are split over; () when they do not divide."""
    axes = tuple(
        a
        for a in sharding.mesh.axis_names
        if a not in sharding.vocab_axes and sharding.mesh.shape[a] > 1
    )
    size = math.prod(sharding.mesh.shape[a] for a in axes)
    return axes if axes and num_rows % size == 0 else ()


def _pad_rows(x, rows, value=0):
    if rows == 0:
        return x
    widths = [(0, rows)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


def _spec(axes, *rest):
    return P(axes if axes else None, *rest)


def _explicit(mesh):
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))


def _shard_mapped(fn, mesh, in_specs, out_specs, args):
    """Runs `fn` under shard_map; on a mesh with explicit axes, reshards the inputs first.

    (On automatic axes shard_map reshards its inputs itself; with explicit
    sharding-in-types it requires them to match the specs already.)
    """
    if _explicit(mesh):
        args = [
            x if x is None else jax.reshard(x, NamedSharding(mesh, spec))
            for x, spec in zip(args, in_specs)
        ]
    return _shard_map(fn, mesh, tuple(in_specs), out_specs)(*args)


def _shard_offset(vocab_axes, local):
    return jax.lax.axis_index(vocab_axes) * local


KERNELS = ("auto", "chunked", "pallas")


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {KERNELS}, received {kernel!r}.")
    return kernel


def _shard_loss_kernel(kernel, label_smoothing, pos_weight, chunk_size, pallas_tile):
    """`(h, t, ids, b) -> [rows]` per-row CutBCE of one shard, for the target platform.

    `kernel="auto"`: Pallas TPU kernels when the program is compiled for a
    TPU, the chunked XLA loop otherwise (`jax.lax.platform_dependent`: only
    the branch of the lowering platform is compiled). `"pallas"` off TPU
    runs the Pallas interpreter.
    """
    settings = dict(label_smoothing=label_smoothing, pos_weight=pos_weight)

    def xla(h, t, i, b):
        return chunked.cut_bce(h, t, i, b, chunk_size=chunk_size, **settings)

    def pallas(interpret):
        def run(h, t, i, b):
            return pallas_tpu.cut_bce(
                h, t, i, b, chunk_size=pallas_tile, interpret=interpret, **settings
            )

        return run

    if kernel == "chunked":
        return xla
    default = pallas(True) if kernel == "pallas" else xla

    def run(h, t, i, b):
        return jax.lax.platform_dependent(h, t, i, b, tpu=pallas(False), default=default)

    return run


def _rebase(ids, offset, local):
    """Ids of this shard moved to `[0, local)`; every other id becomes -1 (padding)."""
    ids = ids.astype(jnp.int32) if ids.dtype.itemsize < 8 else ids
    inside = (ids >= offset) & (ids < offset + local)
    return jnp.where(inside, ids - offset, -1)


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
    """Per-row CutBCE with the table split along V over `sharding.vocab_axes`.

    Same contract and result as `chunked.cut_bce` on one device (up to the
    float summation order); jit-, grad- and vmap-compatible. The
    `shard_map`/`custom_vjp` program is built once per configuration
    (`_loss_program`, cached) and jitted, so eager calls reuse it.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]` (any placement; resharded to `P(vocab_axes,
            None)` if it is not already).
        ids: integer `[M, L]`; ids outside `[0, V)` are padding.
        bias: optional float `[V]`.
        sharding: a `VocabSharding`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float.
        chunk_size: vocabulary tile width per shard; `None`: default rule
            on the per-device rows and shard width (the Pallas kernels then
            use their own tile rule).
        kernel: per-shard kernel: `"auto"` (Pallas when compiled for a TPU,
            else chunked), `"chunked"` or `"pallas"` (interpreted off TPU).

    Returns:
        Float32 `[M]`.

    Example:

    ```python
    spec = VocabSharding(jax.make_mesh((8,), ("model",)), ("model",))
    loss = cut_bce(hidden, table, ids, sharding=spec, chunk_size=256)
    ```
    """
    _check_kernel(kernel)
    ids = ids_as_int32(ids, table.shape[0])  # out-of-range (any width): -1
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
    return program(hidden, table, ids, bias)


@functools.lru_cache(maxsize=64)
def _loss_program(sharding, vocab, num_rows, has_bias, label_smoothing, pos_weight, chunk_size,
                  kernel="auto"):
    """The jitted `(hidden, table, ids, bias) -> [M]` sharded loss of one configuration.

    Cached: an eager call with the same mesh, shapes and settings reuses the
    same `shard_map`/`custom_vjp` closures, so JAX's compilation cache hits.
    """
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    shards = sharding.num_shards
    local = -(-vocab // shards)
    pad = local * shards - vocab
    rows = _row_axes(sharding, num_rows)
    rows_per_device = num_rows // math.prod(mesh.shape[a] for a in rows)
    pallas_tile = chunk_size  # None: the Pallas kernels' own tile rule
    if chunk_size is None:
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    shard_loss = _shard_loss_kernel(kernel, label_smoothing, pos_weight, chunk_size, pallas_tile)

    def shard_sum(h, t, i, b):
        """This shard's `sum_v` of the loss terms, `[rows]`."""
        local_ids = _rebase(i, _shard_offset(vocab_axes, local), local)
        return shard_loss(h, t, local_ids, b) * local

    row_spec, vocab_spec = _spec(rows, None), P(vocab_axes, None)
    bias_spec = P(vocab_axes) if has_bias else None
    in_specs = [row_spec, vocab_spec, row_spec, bias_spec]

    def forward(h, t, i, b):
        return jax.lax.psum(shard_sum(h, t, i, b), vocab_axes)

    def backward(h, t, i, b, g):
        _, pullback = jax.vjp(lambda h, t, b: shard_sum(h, t, i, b), h, t, b)
        grad_h, grad_t, grad_b = pullback(g)
        # One psum over V for the hidden states; table and bias gradients
        # stay sharded along V, summed over the rows' (data) axes only.
        grad_h = jax.lax.psum(grad_h, vocab_axes)
        if rows:
            grad_t = jax.lax.psum(grad_t, rows)
            grad_b = None if b is None else jax.lax.psum(grad_b, rows)
        return grad_h, grad_t, grad_b

    def padded(t, b):
        return _pad_rows(t, pad), None if b is None else _pad_rows(b, pad)

    def unpadded(x):
        """Drops the padded rows of a V-sharded gradient."""
        if not pad:
            return x
        if _explicit(mesh):  # a sharded dim cannot be sliced unevenly
            x = jax.reshard(x, NamedSharding(mesh, P()))
        return x[:vocab]

    @jax.custom_vjp
    def total_of(h, t, i, b):
        t, b = padded(t, b)
        return _shard_mapped(forward, mesh, in_specs, _spec(rows), [h, t, i, b])

    def total_fwd(h, t, i, b):
        return total_of(h, t, i, b), (h, t, i, b)

    def total_bwd(residuals, g):
        h, t, i, b = residuals
        t, b = padded(t, b)
        grads = _shard_mapped(
            backward,
            mesh,
            in_specs + [_spec(rows)],
            (row_spec, vocab_spec, bias_spec),
            [h, t, i, b, g.astype(jnp.float32)],
        )
        grad_b = None if b is None else unpadded(grads[2])
        return grads[0], unpadded(grads[1]), None, grad_b

    total_of.defvjp(total_fwd, total_bwd)
    neg_scale = bce_coefficients(label_smoothing, pos_weight).neg_scale

    @jax.jit
    def program(hidden, table, ids, bias):
        total = total_of(hidden, table, ids, bias)
        if pad:
            # A zero row with zero bias has logit 0: a constant term per padded row.
            total = total - pad * neg_scale * math.log(2.0)
        return total / vocab

    return program


def _merge(scores, ids, k):
    """Top-k of candidates `[M, C]`: score descending, then lower id first."""
    key = jnp.where(ids < 0, jnp.iinfo(jnp.int32).max, ids)
    neg, key = jax.lax.sort((-scores, key), dimension=1, num_keys=2)
    scores, ids = -neg[:, :k], key[:, :k]
    return scores, jnp.where(scores == -jnp.inf, retrieval.EMPTY_ID, ids)


def top_k(hidden, table, k, bias=None, exclude_ids=None, *, sharding, chunk_size=None):
    """Exact top-k logits per row with the table split along V.

    Each device takes its shard's top `min(k, V / shards)` with global ids,
    one `all_gather` brings the candidates together and a merge keeps the
    best k (ties: lower id), as `retrieval.top_k` does on one device. The
    program is built once per configuration (cached, jitted).

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        k: int in `[1, V]`.
        bias: optional float `[V]`.
        exclude_ids: optional int `[M, X]` ids never returned for that row.
        sharding: a `VocabSharding`.
        chunk_size: vocabulary tile width per shard (`None`: default rule).

    Returns:
        `(scores, ids)`: float32 `[M, k]` and int32 `[M, k]`.

    Example:

    ```python
    scores, ids = top_k(hidden, table, 10, sharding=vocab_sharding_of(table))
    ```
    """
    if exclude_ids is not None:
        exclude_ids = ids_as_int32(exclude_ids, table.shape[0])
    program = _retrieval_program(
        "top_k", VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)),
        int(table.shape[0]), int(hidden.shape[0]), bias is not None,
        exclude_ids is not None, int(k), None if chunk_size is None else int(chunk_size),
    )
    return program(hidden, table, bias, exclude_ids)


def count_at_least(hidden, table, bias, threshold, *, sharding, chunk_size=None):
    """Int32 `[M]`: how many of each row's V logits are `>= threshold`, table split along V.

    Each device counts its own shard (`retrieval.count_at_least`) and one
    `psum` over the vocabulary axes adds the counts: the table is never
    gathered. Padded rows (V not divisible by the shard count) get a `-inf`
    bias and are taken back out when `threshold` is `-inf`.

    Args:
        hidden: float `[M, D]`.
        table: float `[V, D]`.
        bias: optional float `[V]`.
        threshold: a Python float.
        sharding: a `VocabSharding`.
        chunk_size: vocabulary tile width per shard (`None`: default rule).

    Returns:
        Int32 `[M]`, the same as `retrieval.count_at_least` on one device.

    Example:

    ```python
    counts = count_at_least(hidden, table, None, 0.0, sharding=vocab_sharding_of(table))
    ```
    """
    program = _retrieval_program(
        "count_at_least", VocabSharding(sharding.mesh, tuple(sharding.vocab_axes)),
        int(table.shape[0]), int(hidden.shape[0]), bias is not None, False,
        float(threshold), None if chunk_size is None else int(chunk_size),
    )
    return program(hidden, table, bias, None)


@functools.lru_cache(maxsize=64)
def _retrieval_program(kind, sharding, vocab, num_rows, has_bias, has_exclude, arg, chunk_size):
    """The jitted sharded `top_k` (`arg` = k) or `count_at_least` (`arg` = threshold).

    Cached per configuration, like `_loss_program`.
    """
    mesh, vocab_axes = sharding.mesh, tuple(sharding.vocab_axes)
    shards = sharding.num_shards
    local = -(-vocab // shards)
    pad = local * shards - vocab
    rows = _row_axes(sharding, num_rows)
    if chunk_size is None:
        rows_per_device = num_rows // math.prod(mesh.shape[a] for a in rows)
        chunk_size = default_chunk_size(rows_per_device, local, chunked.tile_budget())
    with_bias = has_bias or pad > 0

    def shard_top_k(h, t, x=None, b=None):
        offset = _shard_offset(vocab_axes, local)
        x = None if x is None else _rebase(x, offset, local)
        scores, ids = retrieval.top_k(h, t, min(arg, local), b, x, chunk_size=chunk_size)
        ids = jnp.where(ids < 0, ids, ids + offset)
        scores = jax.lax.all_gather(scores, vocab_axes, axis=1, tiled=True)
        ids = jax.lax.all_gather(ids, vocab_axes, axis=1, tiled=True)
        return _merge(scores, ids, arg)

    def shard_count(h, t, x=None, b=None):
        counts = retrieval.count_at_least(h, t, b, arg, chunk_size=chunk_size)
        return jax.lax.psum(counts, vocab_axes)

    in_specs = [
        _spec(rows, None),
        P(vocab_axes, None),
        _spec(rows, None) if has_exclude else None,
        P(vocab_axes) if with_bias else None,
    ]
    out = _spec(rows, None)
    fn, out_specs = (shard_top_k, (out, out)) if kind == "top_k" else (shard_count, _spec(rows))

    @jax.jit
    def program(hidden, table, bias, exclude_ids):
        if with_bias:
            # Padded rows get a -inf logit: never a candidate, never counted.
            bias = jnp.zeros((vocab,), jnp.float32) if bias is None else bias
            bias = _pad_rows(bias, pad, -jnp.inf)
            table = _pad_rows(table, pad)
        result = _shard_mapped(fn, mesh, in_specs, out_specs, [hidden, table, exclude_ids, bias])
        if kind == "count_at_least" and pad and arg == -math.inf:
            result = result - pad  # -inf >= -inf: the padded rows were counted
        return result

    return program
