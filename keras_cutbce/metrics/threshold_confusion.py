"""`ThresholdConfusion`: precision, recall and F1 at a probability threshold, without logits."""

import math
from typing import Optional

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.math.positives import item_logits
from keras_cutbce.metrics.item_table_metric import ItemTableMetric
from keras_cutbce.metrics.item_table_metric import accumulate

__all__ = ["ThresholdConfusion"]

DEFAULT_NAME = "threshold_confusion"


@keras.saving.register_keras_serializable(package="keras_cutbce")
class ThresholdConfusion(ItemTableMetric):
    """Computes precision, recall and F1 of every item at a probability threshold, without logits.

    Each position predicts item v when `sigmoid(h . E_v + b_v) >= threshold`,
    i.e. when its logit is `>= log(threshold / (1 - threshold))`. Over the
    full vocabulary and all positions it accumulates

    - TP: distinct valid targets predicted (their own logits, gathered);
    - FP: items predicted that are not targets (`cut_count_at_least`, tile by
      tile, minus TP; clipped at 0 should the two float paths disagree on a
      logit at the threshold by a rounding);
    - FN: targets not predicted; TN: the rest, `V - #targets - FP`;

    weighted by `sample_weight` (per example, broadcast over positions, or
    per position) and the Keras mask of `y_pred`. Every position counts, also
    those without targets (mask padded positions out); a counted position
    with a NaN logit (a diverged model) makes every count NaN. The counts are float
    accumulators, exposed as the variables `true_positives`,
    `false_positives`, `false_negatives` and `true_negatives` (TN reaches
    `positions x V`: float32 keeps it to ~1e-7 relative precision).

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable (an `ItemEmbedding` with `use_bias=True`
            gives its bias too).
        threshold: probability in `(0, 1)`.
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        name: metric name.
        dtype: dtype of the accumulators (default float32).

    Example:

    ```python
    metric = ThresholdConfusion(items, threshold=0.5)
    model.compile(optimizer="adam", loss=CutBCELoss(items), metrics=[metric])
    model.evaluate(x, target_ids)  # logs precision, recall, f1
    metric.false_positives.numpy()
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
        """Accumulates one batch.

        Args:
            y_true: integer target ids `[..., L]` (or `[...]`, one a position).
            y_pred: hidden states `[..., D]`.
            sample_weight: optional weights `[B]` (broadcast over positions)
                or `[...]` (one a position).
        """
        table, bias = self.read_tables()
        vocab_size = int(table.value.shape[0])
        y_pred, targets, counted, mask = self.prepare(y_true, y_pred, vocab_size)
        predicted = cut_ops.cut_count_at_least(
            y_pred, table, self.logit_threshold, bias=bias, chunk_size=self.chunk_size
        )

        hidden = ops.reshape(y_pred, (-1, ops.shape(y_pred)[-1]))
        bias_value = None if bias is None else bias.value
        logits = item_logits(hidden, table.value, bias_value, targets)
        hit = ops.logical_and(counted, logits >= self.logit_threshold)

        dtype = self.dtype
        positives = ops.sum(ops.cast(counted, dtype), axis=1)
        true_pos = ops.sum(ops.cast(hit, dtype), axis=1)
        predicted = ops.reshape(predicted, (-1,))
        nan_rows = predicted < 0  # a NaN logit: no prediction, the counts are NaN
        predicted = ops.cast(predicted, dtype)
        false_pos = ops.maximum(predicted - true_pos, 0.0)
        weights = self.position_weights(sample_weight, mask, y_pred)
        accumulate(self.true_positives, weights, true_pos, nan_rows)
        accumulate(self.false_positives, weights, false_pos, nan_rows)
        accumulate(self.false_negatives, weights, positives - true_pos, nan_rows)
        accumulate(
            self.true_negatives, weights, float(vocab_size) - positives - false_pos, nan_rows
        )

    def result(self):
        """Returns the dict `{"precision", "recall", "f1"}`.

        Under a non-default name the keys start with it (`"{name}_precision"`);
        a second metric of the same name in one compiled model logs under
        Keras's de-duplicated name (`"threshold_confusion_1_precision"`).
        """
        tp, fp, fn = self.true_positives, self.false_positives, self.false_negatives
        precision = ops.divide_no_nan(tp, tp + fp)
        recall = ops.divide_no_nan(tp, tp + fn)
        f1 = ops.divide_no_nan(2.0 * precision * recall, precision + recall)
        p = self.key_prefix()
        return {f"{p}precision": precision, f"{p}recall": recall, f"{p}f1": f1}

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}
