"""CutBCE on torch with fused Triton kernels (CUDA; CPU tensors run in the Triton interpreter).

The registry's `"triton"` entries: `cut_bce` and `cut_bce_weighted_sum`
(`keras_cutbce.backends.torch.triton.api`). Importing this package does not
import Triton; the first call does.
"""

from keras_cutbce.backends.torch.triton.api import available
from keras_cutbce.backends.torch.triton.api import cut_bce
from keras_cutbce.backends.torch.triton.api import cut_bce_weighted_sum

__all__ = ["available", "cut_bce", "cut_bce_weighted_sum"]
