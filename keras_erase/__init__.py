"""ERASE: early backward of detached blocks for Keras 3.

`DetachBlock` wraps a sub-network with a local objective; `EraseModel` trains it (docs/erase.md).
"""

from keras_erase.detach_block import DetachBlock
from keras_erase.model import EraseModel
from keras_cutbce.version import __version__  # one version for the distribution

__all__ = ["DetachBlock", "EraseModel"]
