"""Exact binary and softmax cross-entropy over huge item vocabularies, without logits."""

from keras_cutbce.ids import count_out_of_range_ids, multi_hot_to_ids, seen_items
from keras_cutbce.item_embedding import ItemEmbedding
from keras_cutbce.loss import CutBCELoss
from keras_cutbce.metrics import MeanReciprocalRank, OutOfRangeTargets, ThresholdConfusion
from keras_cutbce.metrics import TopKRetrieval
from keras_cutbce.ops import cut_binary_crossentropy
from keras_cutbce.ops import cut_top_k
from keras_cutbce.sampled import SampledSoftmaxLoss, cut_sampled_softmax_crossentropy
from keras_cutbce.softmax import CutSoftmaxLoss, cut_categorical_crossentropy
from keras_cutbce.version import __version__

__all__ = [
    "CutBCELoss",
    "CutSoftmaxLoss",
    "ItemEmbedding",
    "MeanReciprocalRank",
    "OutOfRangeTargets",
    "SampledSoftmaxLoss",
    "ThresholdConfusion",
    "TopKRetrieval",
    "count_out_of_range_ids",
    "cut_binary_crossentropy",
    "cut_categorical_crossentropy",
    "cut_sampled_softmax_crossentropy",
    "cut_top_k",
    "multi_hot_to_ids",
    "seen_items",
]
