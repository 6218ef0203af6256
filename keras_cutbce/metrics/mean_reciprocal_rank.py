"""`MeanReciprocalRank`: the exact rank of each position's first target, without logits."""

from typing import Optional
from typing import Sequence

import keras
from keras import ops

from keras_cutbce import ops as cut_ops
from keras_cutbce.common import filled_like
from keras_cutbce.metrics.item_table_metric import accumulate
from keras_cutbce.metrics.ranking_metric import RankingMetric

__all__ = ["MeanReciprocalRank"]

DEFAULT_NAME = "mean_reciprocal_rank"


@keras.saving.register_keras_serializable(package="keras_cutbce")
class MeanReciprocalRank(RankingMetric):
    """The mean of `1 / rank` of each position's first target over the whole catalogue (`"mrr"`).

    The rank is `cut_rank`'s (no cut-off). Positions, weights, exclusions and
    the NaN rule are `RankingMetric`'s; a target excluded for its position is
    never its first (all excluded: 0).

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer.
        exclude_ids: optional list of int item ids excluded everywhere.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        empty_positions: `"skip"` (default) or `"zero"`.
        name: metric name (another than the default prefixes the key).
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    model.compile(optimizer="adam", loss=CutBCELoss(items),
                  metrics=[TopKRetrieval(items, k=10), MeanReciprocalRank(items)])
    ```
    """

    default_name = DEFAULT_NAME

    def __init__(
        self,
        embeddings,
        exclude_ids: Optional[Sequence[int]] = None,
        bias=None,
        chunk_size: Optional[int] = None,
        empty_positions: str = "skip",
        name: str = DEFAULT_NAME,
        dtype: Optional[str] = None,
    ):
        super().__init__(embeddings, exclude_ids, bias, chunk_size, empty_positions, name, dtype)
        self.reciprocal_rank_sum = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="reciprocal_rank_sum"
        )

    def update_state(self, y_true, y_pred, sample_weight=None, exclude_ids=None):
        """Accumulates one batch (`TopKRetrieval.update_state`'s arguments)."""
        inputs = self.ranking_inputs(y_true, y_pred, sample_weight, exclude_ids)
        hidden = ops.reshape(inputs.y_pred, (-1, ops.shape(inputs.y_pred)[-1]))
        targets = ops.where(inputs.counted, inputs.targets, filled_like(inputs.targets, -1))
        exclusions = inputs.exclusions
        if exclusions is not None:
            exclusions = ops.reshape(exclusions, (ops.shape(hidden)[0], -1))
        ranks = cut_ops.cut_rank(hidden, inputs.table, targets, bias=inputs.bias,
                                 exclude_ids=exclusions, chunk_size=self.chunk_size)
        ranks = ops.cast(ranks, self.dtype)
        reciprocal = ops.divide_no_nan(ops.ones_like(ranks), ops.maximum(ranks, ops.zeros_like(ranks)))
        accumulate(self.reciprocal_rank_sum, inputs.weights, reciprocal, ranks < 0)
        self.total_weight.assign_add(ops.sum(inputs.weights))

    def result(self):
        """Returns `{"mrr": ...}` (`"{name}_mrr"` under another name than the default)."""
        return {
            f"{self.key_prefix()}mrr": ops.divide_no_nan(
                self.reciprocal_rank_sum, self.total_weight
            )
        }
