"""Exact binary cross-entropy over huge item vocabularies, without logits."""

from keras_cutbce.loss import CutBCELoss
from keras_cutbce.metrics import ThresholdConfusion, TopKRetrieval
from keras_cutbce.ops import cut_binary_crossentropy, cut_top_k
from keras_cutbce.validation import count_out_of_range_ids

__all__ = [
    "CutBCELoss",
    "ThresholdConfusion",
    "TopKRetrieval",
    "cut_binary_crossentropy",
    "cut_top_k",
]
__version__ = "0.1.0"
