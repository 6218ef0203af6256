"""The Pallas TPU (Mosaic) kernels of both loss families, under `jax.custom_vjp`.

Modules: `api` (entry points), `tiling`, `call`, `kernel`, `logit_terms`,
`config`; the design and its measurements: docs/tpu.md.
"""

from keras_cutbce.backends.jax.pallas.api import (cut_bce, cut_bce_weighted_sum, cut_softmax,
                                                  cut_softmax_weighted_sum, softmax_gradients,
                                                  softmax_statistics)

__all__ = ["cut_bce", "cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum",
           "softmax_gradients", "softmax_statistics"]
