"""`TopKRetrieval`: hit@k, recall@k and ndcg@k without logits."""

import math
from typing import Optional
from typing import Sequence
from typing import Union

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.item_table import static_vocab_size
from keras_cutbce.metrics.item_table_metric import ItemTableMetric

__all__ = ["TopKRetrieval"]

DEFAULT_NAME = "top_k_retrieval"


def _check_depth(cutoffs, vocab_size):
    """Raises unless every cut-off is at most V (unknown V: not checked)."""
    if vocab_size is not None and max(cutoffs) > vocab_size:
        raise ValueError(
            f"`k` must be at most V = {vocab_size} (the number of items). "
            f"Received: k={list(cutoffs)}"
        )


@keras.saving.register_keras_serializable(package="keras_cutbce")
class TopKRetrieval(ItemTableMetric):
    """Computes hit@k, recall@k and ndcg@k of full-vocabulary retrieval, without logits.

    For every position, the top `max(k)` items by logit `h . E_v + b_v` are
    retrieved with `cut_top_k` (exact, ties to the lower id; memory
    O(positions x (k + tile))) and compared with the position's target ids:

    - `hit@k`: 1 if at least one target is in the top k;
    - `recall@k`: distinct targets in the top k / distinct targets;
    - `ndcg@k`: binary-relevance DCG of the top k, `sum 1 / log2(rank + 1)`,
      over the ideal DCG of `min(#targets, k)` hits.

    Each is averaged over positions weighted by `sample_weight` (one weight
    per example, broadcast over its positions, or one per position) and the
    Keras mask of `y_pred`. Positions without a valid target (all padding)
    weigh zero.

    Exclusions: `exclude_ids` given to the constructor are item ids never
    retrieved and never counted as targets (e.g. a padding item 0); the
    per-call `update_state(..., exclude_ids=[..., X])` removes items per
    position (e.g. the user's history) from the retrieved list only: a target
    that is excluded for its position stays a target (a miss).

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable (`keras.layers.Embedding`; an
            `ItemEmbedding` with `use_bias=True` gives its bias too).
        k: an int or a sequence of ints, the cut-offs reported, each at
            most V (checked here when V is known: a table, an `Embedding`
            layer built or not; else at the first update).
        exclude_ids: optional list of int item ids excluded everywhere.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        name: metric name.
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    items = keras.layers.Embedding(num_items, 64)
    ...
    model.compile(
        optimizer="adam",
        loss=CutBCELoss(items),
        metrics=[TopKRetrieval(items, k=(10, 50), exclude_ids=[0])],
    )
    model.evaluate(sequences, next_items)  # logs hit@10, recall@10, ndcg@10, ...

    # Own evaluation loop, excluding each user's history:
    metric = TopKRetrieval(items, k=10)
    metric.update_state(next_items, hidden, exclude_ids=history)
    metric.result()["ndcg@10"]
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
    ):
        super().__init__(embeddings, bias, chunk_size, name, dtype)
        self.k = checks.check_cutoffs(k)
        _check_depth(self.k, static_vocab_size(embeddings))
        self.exclude_ids = checks.check_id_list(exclude_ids, "exclude_ids")
        self._sums = {}
        for cut in self.k:
            for measure in ("hit", "recall", "ndcg"):
                self._sums[f"{measure}@{cut}"] = self.add_variable(
                    shape=(), initializer="zeros", dtype=self.dtype, name=f"{measure}_at_{cut}"
                )
        self.total_weight = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="total_weight"
        )

    def update_state(self, y_true, y_pred, sample_weight=None, exclude_ids=None):
        """Accumulates one batch.

        Args:
            y_true: integer target ids `[..., L]` (or `[...]`, one a position).
            y_pred: hidden states `[..., D]`.
            sample_weight: optional weights `[B]` (broadcast over positions)
                or `[...]` (one a position).
            exclude_ids: optional integer ids `[..., X]` never retrieved for
                that position (ids outside `[0, V)` ignored).
        """
        table, bias = self.read_tables()
        vocab_size = int(table.value.shape[0])
        depth = max(self.k)
        _check_depth(self.k, vocab_size)
        never = tuple(i for i in self.exclude_ids if 0 <= i < vocab_size)
        y_pred, targets, counted, mask = self.prepare(y_true, y_pred, vocab_size, never)

        exclusions = None
        if exclude_ids is not None:
            exclusions = checks.int32_ids(exclude_ids, y_pred, vocab_size, "exclude_ids")
        if never:
            constant = ops.zeros_like(y_pred[..., :1], dtype="int32") + ops.convert_to_tensor(
                never, dtype="int32"
            )
            exclusions = (
                constant if exclusions is None else ops.concatenate([exclusions, constant], -1)
            )
        _, top_ids = cut_ops.cut_top_k(
            y_pred, table, depth, bias=bias, exclude_ids=exclusions, chunk_size=self.chunk_size
        )
        top_ids = ops.reshape(top_ids, (-1, depth))
        num_targets = ops.sum(ops.cast(counted, self.dtype), axis=1)  # [M]
        match = ops.expand_dims(top_ids, 2) == ops.expand_dims(targets, 1)  # [M, depth, L]
        relevant = ops.cast(
            ops.any(ops.logical_and(match, ops.expand_dims(counted, 1)), axis=2), self.dtype
        )  # [M, depth]: the item at this rank is a target

        discounts = ops.convert_to_tensor(
            [1.0 / math.log2(rank + 2) for rank in range(depth)], dtype=self.dtype
        )
        hits_cum = ops.cumsum(relevant, axis=1)
        dcg_cum = ops.cumsum(relevant * discounts, axis=1)
        ideal_cum = ops.cumsum(discounts)

        weights = self.position_weights(sample_weight, mask, y_pred)
        weights = weights * ops.cast(num_targets > 0, self.dtype)
        safe_targets = ops.maximum(num_targets, 1.0)
        sums = iter(self._sums.values())
        for cut in self.k:
            last = cut - 1
            hits = hits_cum[:, last]
            ideal_last = ops.cast(ops.minimum(safe_targets, float(cut)), "int32") - 1
            values = {
                "hit": ops.cast(hits > 0, self.dtype),
                "recall": hits / safe_targets,
                "ndcg": dcg_cum[:, last] / ops.take(ideal_cum, ideal_last),
            }
            for measure in ("hit", "recall", "ndcg"):
                next(sums).assign_add(ops.sum(weights * values[measure]))
        self.total_weight.assign_add(ops.sum(weights))

    def result(self):
        """Returns the dict `{"hit@k", "recall@k", "ndcg@k"}` for every cut-off k.

        With a `name` other than the default the keys start with it
        (`"{name}_hit@k"`), so two metrics in one model log apart; a second
        metric of the same name in one compiled model logs under Keras's
        de-duplicated name (`"top_k_retrieval_1_hit@k"`).
        """
        prefix = self.key_prefix()
        return {
            f"{prefix}{key}": ops.divide_no_nan(variable, self.total_weight)
            for key, variable in self._sums.items()
        }

    def get_config(self):
        return {
            **super().get_config(),
            "k": list(self.k),
            "exclude_ids": list(self.exclude_ids) or None,
        }
