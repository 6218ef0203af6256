"""Exact binary cross-entropy over huge item vocabularies, without logits."""

from keras_cutbce.loss import CutBCELoss
from keras_cutbce.ops import cut_binary_crossentropy

__all__ = ["CutBCELoss", "cut_binary_crossentropy"]
__version__ = "0.1.0"
