"""CutBCE as a Pallas TPU (Mosaic) kernel, under `jax.custom_vjp`.

The loss of a row is `(1 / V) * sum_v term(z_v)`, computed by one kernel
that makes one pass over the table per block of resident rows; a
`[row_tile, tile]` logits tile exists only in VMEM, float32 accumulators
live in VMEM. Each logit's term is exact for its role (a negative, or a
positive found from the row's sorted ids), with `logit_terms`' per-logit
functions (the same function as `keras_cutbce.backends.jax.math`'s, in
fewer vector ops), so the positives need no gather or scatter over the
table.

- `api`: `cut_bce`, `cut_bce_weighted_sum` (exported here), the settings
  and the `custom_vjp` (`keras_cutbce.backends.jax.vjp`);
- `tiling`: the tile and VMEM rule;
- `call`: the `pallas_call` plumbing, one call per resident row block;
- `kernel`: the kernel (a step's tile in register-sized pieces);
- `logit_terms`: the per-logit loss and slope of the kernel;
- `config`: the static settings of a call and of a pass.

The design, its measurements and the roofline are in `docs/tpu.md`.

Example:

>>> import numpy as np
>>> h = np.random.normal(size=(4, 8)).astype("float32")
>>> table = np.random.normal(size=(300, 8)).astype("float32")
>>> ids = np.array([[1, 2], [3, -1], [5, 5], [0, 299]])
>>> cut_bce(h, table, ids, None, label_smoothing=0.0, pos_weight=1.0).shape
(4,)
"""

from keras_cutbce.backends.jax.pallas.api import (cut_bce, cut_bce_weighted_sum, cut_softmax,
                                                  cut_softmax_weighted_sum, softmax_gradients,
                                                  softmax_statistics)

__all__ = ["cut_bce", "cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum",
           "softmax_gradients", "softmax_statistics"]
