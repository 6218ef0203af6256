"""The loss families and top-k with the item table split along V over a JAX mesh.

Each device runs the single-device kernels on its shard inside `shard_map`;
one all-gather of the rows' sums combines them (docs/tpu.md, "Pod scale").
"""

from keras_cutbce.backends.jax.sharded.discovery import VocabSharding, vocab_sharding_of
from keras_cutbce.backends.jax.sharded.loss import KERNELS, cut_bce, cut_softmax
from keras_cutbce.backends.jax.sharded.retrieval import count_above, top_k

__all__ = ["KERNELS", "VocabSharding", "count_above", "cut_bce", "cut_softmax", "top_k",
           "vocab_sharding_of"]
