"""`TopKRetrieval`: hit@k, recall@k, ndcg@k and precision@k without logits."""

from typing import Optional
from typing import Sequence
from typing import Union

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.common import filled_like
from keras_cutbce.item_table import static_vocab_size
from keras_cutbce.metrics.item_table_metric import accumulate
from keras_cutbce.metrics.ranking_metric import RankingMetric

__all__ = ["TopKRetrieval"]

DEFAULT_NAME = "top_k_retrieval"
MEASURES = ("hit", "recall", "ndcg", "precision")


def _check_depth(cutoffs, vocab_size):
    if vocab_size is not None and max(cutoffs) > vocab_size:
        raise ValueError(
            f"`k` must be at most V = {vocab_size} (the number of items). "
            f"Received: k={list(cutoffs)}"
        )


@keras.saving.register_keras_serializable(package="keras_cutbce")
class TopKRetrieval(RankingMetric):
    """hit@k, recall@k, ndcg@k and precision@k of full-vocabulary retrieval (`cut_top_k`), without logits.

    Averaged over positions weighted by `sample_weight` and the mask (a
    position without a valid target: `empty_positions`; a counted NaN logit
    makes every value NaN). Constructor `exclude_ids` are never retrieved nor
    targets; per-call `exclude_ids [..., X]` are removed from that position's
    list only (an excluded target stays a miss).

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with an
            `embeddings` variable (an `ItemEmbedding`'s bias is used).
        k: an int or a sequence of ints, each at most V.
        exclude_ids: optional list of int item ids excluded everywhere.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        empty_positions: `"skip"` (default) or `"zero"`.
        name: metric name.
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    model.compile(optimizer="adam", loss=CutBCELoss(items),
                  metrics=[TopKRetrieval(items, k=(10, 50), exclude_ids=[0])])
    metric = TopKRetrieval(items, k=10)   # own loop, excluding the history:
    metric.update_state(next_items, hidden, exclude_ids=keras_cutbce.seen_items(sequences))
    ```
    """

    default_name = DEFAULT_NAME

    def __init__(
        self,
        embeddings,
        k: Union[int, Sequence[int]] = (8, 10),
        exclude_ids: Optional[Sequence[int]] = None,
        bias=None,
        chunk_size: Optional[int] = None,
        name: str = DEFAULT_NAME,
        dtype: Optional[str] = None,
        empty_positions: str = "skip",
    ):
        super().__init__(embeddings, exclude_ids, bias, chunk_size, empty_positions, name, dtype)
        self.k = checks.check_cutoffs(k)
        _check_depth(self.k, static_vocab_size(embeddings))
        self._sums = {}
        for cut in self.k:
            for measure in MEASURES:
                self._sums[f"{measure}@{cut}"] = self.add_variable(
                    shape=(), initializer="zeros", dtype=self.dtype, name=f"{measure}_at_{cut}"
                )

    def update_state(self, y_true, y_pred, sample_weight=None, exclude_ids=None):
        """Accumulates one batch.

        Args:
            y_true: integer target ids `[..., L]` (or `[...]`, one a position).
            y_pred: hidden states `[..., D]`.
            sample_weight: optional weights `[B]` or `[...]`.
            exclude_ids: optional integer ids `[..., X]` never retrieved there.
        """
        inputs = self.ranking_inputs(y_true, y_pred, sample_weight, exclude_ids)
        depth = max(self.k)
        _check_depth(self.k, int(inputs.table.vocab_size))
        top_scores, top_ids = cut_ops.cut_top_k(
            inputs.y_pred, inputs.table, depth, bias=inputs.bias,
            exclude_ids=inputs.exclusions, chunk_size=self.chunk_size,
        )
        top_ids = ops.reshape(top_ids, (-1, depth))
        nan_rows = ops.isnan(ops.reshape(top_scores, (-1, depth))[:, 0])
        targets, counted = inputs.targets, inputs.counted
        match = ops.expand_dims(top_ids, 2) == ops.expand_dims(targets, 1)  # [M, depth, L]
        relevant = ops.cast(
            ops.any(ops.logical_and(match, ops.expand_dims(counted, 1)), axis=2), self.dtype
        )  # [M, depth]: the item at this rank is a target

        # 1 / log2(rank + 2), made on the device: a tensor of host data is a copy (a sync on CUDA)
        discounts = 1.0 / ops.log2(ops.arange(2, depth + 2, dtype=self.dtype))
        hits_cum = ops.cumsum(relevant, axis=1)
        dcg_cum = ops.cumsum(relevant * discounts, axis=1)
        ideal_cum = ops.cumsum(discounts)

        safe_targets = ops.maximum(inputs.num_targets, ops.ones_like(inputs.num_targets))
        sums = iter(self._sums.values())
        for cut in self.k:
            last = cut - 1
            hits = hits_cum[:, last]
            ideal_last = ops.cast(ops.minimum(safe_targets, filled_like(safe_targets, cut)), "int32") - 1
            values = {
                "hit": ops.cast(hits > 0, self.dtype),
                "recall": hits / safe_targets,
                "ndcg": dcg_cum[:, last] / ops.take(ideal_cum, ideal_last),
                "precision": hits / float(cut),
            }
            for measure in MEASURES:
                accumulate(next(sums), inputs.weights, values[measure], nan_rows)
        self.total_weight.assign_add(ops.sum(inputs.weights))

    def result(self):
        """`{"hit@k", "recall@k", "ndcg@k", "precision@k"}` for every cut-off, prefixed as `key_prefix` says."""
        prefix = self.key_prefix()
        return {
            f"{prefix}{key}": ops.divide_no_nan(variable, self.total_weight)
            for key, variable in self._sums.items()
        }

    def get_config(self):
        return {**super().get_config(), "k": list(self.k)}
