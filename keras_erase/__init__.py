"""ERASE: early backward of detached blocks for Keras 3.

`DetachBlock` wraps a sub-architecture (detached input/output, local objective);
`EraseModel` adds the local losses to the model's loss on every backend and, on
torch, launches each block's backward pass as soon as its forward pass is done.
"""

from keras_erase.detach_block import DetachBlock
from keras_erase.model import EraseModel
from keras_cutbce.version import __version__  # one version for the distribution

__all__ = ["DetachBlock", "EraseModel"]
