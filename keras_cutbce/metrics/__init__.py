"""Keras metrics over the full item vocabulary, without logits (docs/cutbce.md defines them)."""

from keras_cutbce.metrics.item_table_metric import ItemTableMetric
from keras_cutbce.metrics.mean_reciprocal_rank import MeanReciprocalRank
from keras_cutbce.metrics.out_of_range_targets import OutOfRangeTargets
from keras_cutbce.metrics.ranking_metric import RankingMetric
from keras_cutbce.metrics.threshold_confusion import ThresholdConfusion
from keras_cutbce.metrics.top_k_retrieval import TopKRetrieval

__all__ = [
    "ItemTableMetric",
    "MeanReciprocalRank",
    "OutOfRangeTargets",
    "RankingMetric",
    "ThresholdConfusion",
    "TopKRetrieval",
]
