"""Keras metrics over the full item vocabulary, computed without logits.

- `TopKRetrieval` (`top_k_retrieval.py`): hit@k, recall@k and ndcg@k of the
  top-k items retrieved for each position by `cut_top_k`.
- `ThresholdConfusion` (`threshold_confusion.py`): TP, FP, FN, TN of every
  item at a probability threshold, counted by `cut_count_at_least`,
  reported as precision, recall and F1.
- `OutOfRangeTargets` (`out_of_range_targets.py`): the target ids outside
  `[0, V)` the loss ignores (beyond the padding id), and the positions and
  batches without a valid target; it reads only V, not the table.

The first two derive from `ItemTableMetric` (`item_table_metric.py`): they take the
item table like `CutBCELoss` does and read its current value at every
update (the traced one in JAX's train and test steps), and run the
vocabulary-sharded kernels when the table is split along V over a JAX mesh.
"""

from keras_cutbce.metrics.item_table_metric import ItemTableMetric
from keras_cutbce.metrics.out_of_range_targets import OutOfRangeTargets
from keras_cutbce.metrics.threshold_confusion import ThresholdConfusion
from keras_cutbce.metrics.top_k_retrieval import TopKRetrieval

__all__ = ["ItemTableMetric", "OutOfRangeTargets", "ThresholdConfusion", "TopKRetrieval"]
