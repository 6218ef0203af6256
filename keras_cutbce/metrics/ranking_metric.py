"""`RankingMetric`: the base of the metrics over each position's ranking of the whole catalogue.

What every ranking metric here shares, written once: the exclusions (the
constructor's ids, never retrieved and never targets; the per-call
`exclude_ids [..., X]`, out of the position's ranking only), which positions
count (`empty_positions`), and the NaN rule (a counted position without a
ranking makes the metric NaN).
"""

from typing import NamedTuple

from keras import ops

from keras_cutbce import checks
from keras_cutbce.metrics.item_table_metric import ItemTableMetric

__all__ = ["EMPTY_POSITIONS", "RankingInputs", "RankingMetric"]

# How a position without a valid target counts: "skip" (weight 0, the default)
# or "zero" (value 0 at its weight, the keras-rs convention).
EMPTY_POSITIONS = ("skip", "zero")


class RankingInputs(NamedTuple):
    """One update's checked inputs (see `RankingMetric.ranking_inputs`)."""

    table: object
    bias: object
    y_pred: object
    targets: object
    counted: object
    num_targets: object
    exclusions: object
    weights: object


class RankingMetric(ItemTableMetric):
    """A metric of each position's ranking of all V items (by logit, ties to the lower id).

    Subclasses add their sums and accumulate them with `item_table_metric.
    accumulate` on `ranking_inputs(...).weights`, and add the weights to
    `total_weight`, the divisor of their results.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable.
        exclude_ids: optional list of int item ids excluded everywhere: never
            ranked and never counted as targets (e.g. a padding item 0).
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        empty_positions: how a position without a valid target counts:
            `"skip"` (weight 0) or `"zero"` (value 0 at its weight, as
            keras-rs's ranking metrics count a list without a relevant item).
        name: metric name.
        dtype: dtype of the accumulators (default float32).
    """

    def __init__(self, embeddings, exclude_ids=None, bias=None, chunk_size=None,
                 empty_positions="skip", name=None, dtype=None):
        super().__init__(embeddings, bias, chunk_size, name, dtype)
        if empty_positions not in EMPTY_POSITIONS:
            raise ValueError(
                f"`empty_positions` must be one of {EMPTY_POSITIONS}. "
                f"Received: empty_positions={empty_positions!r}"
            )
        self.empty_positions = empty_positions
        self.exclude_ids = checks.check_id_list(exclude_ids, "exclude_ids")
        self.total_weight = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="total_weight"
        )

    def ranking_inputs(self, y_true, y_pred, sample_weight=None, exclude_ids=None):
        """Returns one update's checked inputs as `RankingInputs`.

        `targets [M, L]` and `counted [M, L]` are each position's distinct
        valid targets (the constructor's exclusions dropped),
        `num_targets [M]` their count, `exclusions [..., X]` the per-call
        ids with the constructor's (None without any), and `weights [M]`
        the positions' weights (`sample_weight` times the Keras mask, zero
        for an empty position under `empty_positions="skip"`).
        """
        table, bias = self.read_tables()
        vocab_size = int(table.value.shape[0])
        never = tuple(i for i in self.exclude_ids if 0 <= i < vocab_size)
        y_pred, targets, counted, mask = self.prepare(y_true, y_pred, vocab_size, never)
        exclusions = None
        if exclude_ids is not None:
            exclusions = checks.int32_ids(
                exclude_ids, y_pred, vocab_size, "exclude_ids", one_per_position=False
            )
        if never:
            constant = ops.zeros_like(y_pred[..., :1], dtype="int32") + ops.convert_to_tensor(
                never, dtype="int32"
            )
            exclusions = (
                constant if exclusions is None else ops.concatenate([exclusions, constant], -1)
            )
        num_targets = ops.sum(ops.cast(counted, self.dtype), axis=1)
        weights = self.position_weights(sample_weight, mask, y_pred)
        if self.empty_positions == "skip":
            weights = weights * ops.cast(num_targets > 0, self.dtype)
        return RankingInputs(table, bias, y_pred, targets, counted, num_targets, exclusions,
                             weights)

    def get_config(self):
        return {
            **super().get_config(),
            "exclude_ids": list(self.exclude_ids) or None,
            "empty_positions": self.empty_positions,
        }

