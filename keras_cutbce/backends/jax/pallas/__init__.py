"""The Pallas TPU (Mosaic) kernels of both loss families, under `jax.custom_vjp`.

Modules: `api` (the entry points and their `pallas_call`s), `kernel` (the
kernel and BCE's per-logit terms), `tiling` (the static settings, the tile and
VMEM rule); the design and its measurements: docs/tpu.md.
"""

from keras_cutbce.backends.jax.pallas.api import (cut_bce, cut_bce_weighted_sum, cut_softmax,
                                                  cut_softmax_weighted_sum, softmax_gradients,
                                                  softmax_statistics)

__all__ = ["cut_bce", "cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum",
           "softmax_gradients", "softmax_statistics"]
