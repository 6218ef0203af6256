"""The Pallas TPU (Mosaic) kernels of both loss families, under `jax.custom_vjp`.

One path: `api` (the host: the entry points, the static `Config`, the tile and
VMEM rule, the passes under the `custom_vjp`, the `pallas_call`s) -> `kernel`
(the TPU core: the loop, given a loss family, `kernel.BCE` or `kernel.Softmax`);
the design and its measurements: docs/tpu.md.
"""

from keras_cutbce.backends.jax.pallas.api import (cut_bce, cut_bce_weighted_sum, cut_softmax,
                                                  cut_softmax_weighted_sum, softmax_gradients,
                                                  softmax_statistics)

__all__ = ["cut_bce", "cut_bce_weighted_sum", "cut_softmax", "cut_softmax_weighted_sum",
           "softmax_gradients", "softmax_statistics"]
