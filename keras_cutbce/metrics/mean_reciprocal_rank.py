"""`MeanReciprocalRank`: the exact rank of each position's first target, without logits."""

from typing import Optional
from typing import Sequence

import keras
from keras import ops

from keras_cutbce import ops as cut_ops
from keras_cutbce.metrics.item_table_metric import accumulate
from keras_cutbce.metrics.ranking_metric import RankingMetric

__all__ = ["MeanReciprocalRank"]

DEFAULT_NAME = "mean_reciprocal_rank"


@keras.saving.register_keras_serializable(package="keras_cutbce")
class MeanReciprocalRank(RankingMetric):
    """Computes the mean reciprocal rank (MRR) of each position's first target over the whole catalogue.

    A position's first target is the one its ranking of all V items puts
    highest (the highest logit, then the lower id); its rank is 1 + the
    number of items ranked above it, counted tile by tile over the
    vocabulary by `keras_cutbce.ops.cut_rank` (no logits, no cut-off: a
    target at rank 40,000 counts 1/40,000). The metric is the weighted mean
    of `1 / rank` over positions, logged as `"mrr"`.

    Positions, weights, exclusions and the NaN rule are those of
    `TopKRetrieval`: a position without a valid target weighs zero
    (`empty_positions="skip"`) or counts as 0 (`"zero"`, keras-rs's
    convention); constructor `exclude_ids` are out of every ranking and
    never targets; per-call `exclude_ids [..., X]` are out of that position's
    ranking, and a target excluded there is never its first (all excluded:
    0); a counted position with a NaN logit makes the metric NaN.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable.
        exclude_ids: optional list of int item ids excluded everywhere.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        empty_positions: `"skip"` (default) or `"zero"`.
        name: metric name; under another name than the default the key
            starts with it (`"{name}_mrr"`).
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    model.compile(optimizer="adam", loss=CutBCELoss(items),
                  metrics=[TopKRetrieval(items, k=10), MeanReciprocalRank(items)])
    model.evaluate(sequences, next_items)  # logs hit@10, ..., mrr
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
        """Accumulates one batch.

        Args:
            y_true: integer target ids `[..., L]` (or `[...]`, one a position).
            y_pred: hidden states `[..., D]`.
            sample_weight: optional weights `[B]` (broadcast over positions)
                or `[...]` (one a position).
            exclude_ids: optional integer ids `[..., X]` out of that
                position's ranking (ids outside `[0, V)` ignored).
        """
        inputs = self.ranking_inputs(y_true, y_pred, sample_weight, exclude_ids)
        hidden = ops.reshape(inputs.y_pred, (-1, ops.shape(inputs.y_pred)[-1]))
        targets = ops.where(inputs.counted, inputs.targets, -1)
        exclusions = inputs.exclusions
        if exclusions is not None:
            exclusions = ops.reshape(exclusions, (ops.shape(hidden)[0], -1))
        ranks = cut_ops.cut_rank(hidden, inputs.table, targets, bias=inputs.bias,
                                 exclude_ids=exclusions, chunk_size=self.chunk_size)
        ranks = ops.cast(ranks, self.dtype)
        reciprocal = ops.divide_no_nan(ops.ones_like(ranks), ops.maximum(ranks, 0.0))
        accumulate(self.reciprocal_rank_sum, inputs.weights, reciprocal, ranks < 0)
        self.total_weight.assign_add(ops.sum(inputs.weights))

    def result(self):
        """Returns `{"mrr": ...}` (`"{name}_mrr"` under another name than the default)."""
        return {
            f"{self.key_prefix()}mrr": ops.divide_no_nan(
                self.reciprocal_rank_sum, self.total_weight
            )
        }
