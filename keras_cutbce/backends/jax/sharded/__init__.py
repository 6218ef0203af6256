"""CutBCE and top-k with the item table sharded over a JAX mesh axis along V.

When the table `E [V, D]` is split over one or more mesh axes along the
vocabulary (`NamedSharding(mesh, P("model", None))`, or a Keras
`ModelParallel` `LayoutMap` entry `("model", None)`), each device runs the
single-device kernels on its own shard inside `jax.shard_map`, and one
collective combines the results.

- `discovery`: `VocabSharding` and `vocab_sharding_of` (where a table is split);
- `loss`: `cut_bce` (one `psum` of the loss, table gradients stay sharded);
- `retrieval`: `top_k` (one `all_gather` of candidates) and `count_above` (one `psum`);
- `mesh`: the `shard_map` plumbing they share.

Every public name is exported here; import them from this package. Per-chip
HBM at 10^7 and 10^8 items: `docs/tpu.md`.

Example:

```python
mesh = jax.make_mesh((2, 4), ("data", "model"))
table = jax.device_put(table, NamedSharding(mesh, P("model", None)))
spec = vocab_sharding_of(table)            # VocabSharding(mesh, ("model",))
loss = cut_bce(hidden, table, ids, sharding=spec)           # [M]
scores, ids = top_k(hidden, table, 10, sharding=spec)       # [M, 10]
```
"""

from keras_cutbce.backends.jax.sharded.discovery import VocabSharding, vocab_sharding_of
from keras_cutbce.backends.jax.sharded.loss import KERNELS, cut_bce, cut_softmax
from keras_cutbce.backends.jax.sharded.retrieval import count_above, top_k

__all__ = ["KERNELS", "VocabSharding", "count_above", "cut_bce", "cut_softmax", "top_k",
           "vocab_sharding_of"]
