"""`ThresholdConfusion`: precision, recall and F1 at a probability threshold, without logits."""

import math
from typing import Optional

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.metrics.item_table_metric import ItemTableMetric
from keras_cutbce.metrics.item_table_metric import accumulate

__all__ = ["ThresholdConfusion"]

DEFAULT_NAME = "threshold_confusion"


@keras.saving.register_keras_serializable(package="keras_cutbce")
class ThresholdConfusion(ItemTableMetric):
    """Precision, recall and F1 of every item at a probability threshold, without logits.

    A position predicts item v when `sigmoid(h . E_v + b_v) >= threshold`.
    TP (targets' own logits), FP (`cut_count_at_least` minus TP, clipped at
    0), FN and TN (`V - #targets - FP`) accumulate in the variables
    `true_positives`, ... weighted by `sample_weight` and the mask; every
    position counts; a counted NaN logit makes every count NaN.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer.
        threshold: probability in `(0, 1)`.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        name: metric name.
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    model.compile(optimizer="adam", loss=CutBCELoss(items),
                  metrics=[ThresholdConfusion(items, threshold=0.5)])  # precision, recall, f1
    ```
    """

    default_name = DEFAULT_NAME

    def __init__(
        self,
        embeddings,
        threshold: float = 0.5,
        bias=None,
        chunk_size: Optional[int] = None,
        name: str = DEFAULT_NAME,
        dtype: Optional[str] = None,
    ):
        threshold = checks.check_probability(threshold, "threshold")
        super().__init__(embeddings, bias, chunk_size, name, dtype)
        self.threshold = threshold
        self.logit_threshold = math.log(threshold) - math.log1p(-threshold)
        for name_ in ("true_positives", "false_positives", "false_negatives", "true_negatives"):
            setattr(
                self,
                name_,
                self.add_variable(shape=(), initializer="zeros", dtype=self.dtype, name=name_),
            )

    def update_state(self, y_true, y_pred, sample_weight=None):
        """Accumulates one batch: `y_true` ids `[..., L]`, `y_pred` `[..., D]`, optional `sample_weight`."""
        table, bias = self.read_tables()
        vocab_size = int(table.vocab_size)
        y_pred, targets, counted, mask = self.prepare(y_true, y_pred, vocab_size)
        predicted = cut_ops.cut_count_at_least(
            y_pred, table, self.logit_threshold, bias=bias, chunk_size=self.chunk_size
        )

        hidden = ops.reshape(y_pred, (-1, ops.shape(y_pred)[-1]))
        bias_value = None if bias is None else bias.value
        logits = table.item_logits(hidden, bias_value, targets)
        hit = ops.logical_and(counted, logits >= self.logit_threshold)

        dtype = self.dtype
        positives = ops.sum(ops.cast(counted, dtype), axis=1)
        true_pos = ops.sum(ops.cast(hit, dtype), axis=1)
        predicted = ops.reshape(predicted, (-1,))
        nan_rows = predicted < 0  # a NaN logit: no prediction, the counts are NaN
        predicted = ops.cast(predicted, dtype)
        false_pos = ops.relu(predicted - true_pos)
        weights = self.position_weights(sample_weight, mask, y_pred)
        accumulate(self.true_positives, weights, true_pos, nan_rows)
        accumulate(self.false_positives, weights, false_pos, nan_rows)
        accumulate(self.false_negatives, weights, positives - true_pos, nan_rows)
        accumulate(
            self.true_negatives, weights, float(vocab_size) - positives - false_pos, nan_rows
        )

    def result(self):
        """`{"precision", "recall", "f1"}`, prefixed as `ItemTableMetric.key_prefix` says."""
        tp, fp, fn = self.true_positives, self.false_positives, self.false_negatives
        precision = ops.divide_no_nan(tp, tp + fp)
        recall = ops.divide_no_nan(tp, tp + fn)
        f1 = ops.divide_no_nan(2.0 * precision * recall, precision + recall)
        p = self.key_prefix()
        return {f"{p}precision": precision, f"{p}recall": recall, f"{p}f1": f1}

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}
