"""Keras metrics over the full item vocabulary, computed without logits.

- `TopKRetrieval` (`top_k_retrieval.py`): hit@k, recall@k, ndcg@k and
  precision@k of the top-k items retrieved for each position by `cut_top_k`.
- `MeanReciprocalRank` (`mean_reciprocal_rank.py`): the mean of 1 / the
  exact rank of each position's first target, counted by `cut_rank`.
- `ThresholdConfusion` (`threshold_confusion.py`): TP, FP, FN, TN of every
  item at a probability threshold, counted by `cut_count_at_least`,
  reported as precision, recall and F1.
- `OutOfRangeTargets` (`out_of_range_targets.py`): the target ids outside
  `[0, V)` the loss ignores (beyond the padding id), and the positions and
  batches without a valid target; it reads only V, not the table.

The first three derive from `ItemTableMetric` (`item_table_metric.py`): they take the
item table like `CutBCELoss` does and read its current value at every
update (the traced one in JAX's train and test steps), and run the
vocabulary-sharded kernels when the table is split along V over a JAX mesh.
The two ranking metrics share `RankingMetric` (`ranking_metric.py`): the
exclusions, which positions count, and the NaN rule.
"""

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
