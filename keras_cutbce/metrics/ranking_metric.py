"""`RankingMetric`: the exclusions, the counted positions and the NaN rule of the ranking metrics, once."""

from typing import NamedTuple

from keras import ops

from keras_cutbce import _keras_private
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

    Subclasses accumulate with `item_table_metric.accumulate` on
    `ranking_inputs(...).weights` and add the weights to `total_weight`.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer.
        exclude_ids: optional list of int ids never ranked nor counted as targets.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        empty_positions: a position without a valid target: `"skip"` (weight
            0) or `"zero"` (value 0, keras-rs's convention).
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

    @_keras_private.usable_after_refusal()
    def ranking_inputs(self, y_true, y_pred, sample_weight=None, exclude_ids=None):
        """One update's checked `RankingInputs` (targets, counted, num_targets, exclusions, weights)."""
        table, bias = self.read_tables()
        vocab_size = int(table.vocab_size)
        never = tuple(i for i in self.exclude_ids if 0 <= i < vocab_size)
        y_pred, targets, counted, mask = self.prepare(y_true, y_pred, vocab_size, never)
        exclusions = None
        if exclude_ids is not None:
            exclusions = checks.int32_ids(
                exclude_ids, y_pred, vocab_size, "exclude_ids", one_per_position=False
            )
        if never:
            zeros = ops.zeros_like(y_pred[..., :1], dtype="int32")  # the ids added on the device, not copied
            constant = ops.concatenate([zeros + i for i in never], -1)
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

