"""Keras metrics over the full item vocabulary, computed without logits.

- `TopKRetrieval`: hit@k, recall@k and ndcg@k of the top-k items retrieved
  for each position by `cut_top_k` (a running top-k, tile by tile).
- `ThresholdConfusion`: TP, FP, FN, TN of every item at a probability
  threshold, counted tile by tile by `cut_count_at_least`, reported as
  precision, recall and F1.

Both take the item table like `CutBCELoss` does (a `keras.Variable` `[V, D]`
or a layer holding one, such as `keras.layers.Embedding`) and read its
current value at every update, so the table being trained is the one scored
(in JAX's stateless train and test steps too). `y_true` are integer item ids
`[..., L]` (ids outside `[0, V)` are padding, duplicates count once) and
`y_pred` the hidden states `[..., D]`; the ids stay integral.
"""

import inspect
import math

import keras
from keras import ops
from keras.src.backend.common import stateless_scope
from keras.src.backend.common.masking import get_keras_mask

from keras_cutbce import ops as cut_ops
from keras_cutbce.loss import _find_model_variable, _variable_of, rebind_variables, variable_path

_JAX_STEPS = ("train_step", "test_step", "predict_step")


def _value_in_jax_step(variable):
    """The value a JAX trainer step is running with for `variable`, if any.

    Keras's JAX trainer updates metrics in a `StatelessScope` that maps only
    the metric variables; the model's variables are the step's `state`
    arguments. Reading the variable itself there would bake its value at
    trace time into the compiled step, so we look the step up the stack and
    take the matching entry of its `state`.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            model = frame.f_locals.get("self")
            state = frame.f_locals.get("state")
            if (
                frame.f_code.co_name in _JAX_STEPS
                and isinstance(model, keras.Model)
                and isinstance(state, (tuple, list))
                and len(state) >= 2
            ):
                references = list(model.trainable_variables) + list(
                    model.non_trainable_variables
                )
                values = list(state[0]) + list(state[1])
                if len(references) == len(values):
                    for reference, value in zip(references, values):
                        if reference is variable:
                            return value
            frame = frame.f_back
    finally:
        del frame
    return None


def _resolve(source, argument):
    """Current value of a table or bias given as a variable, layer, tensor or variable path."""
    if isinstance(source, str):
        variable = _find_model_variable(source)
        if variable is None:
            raise ValueError(
                f"`{argument}` refers to the variable {source!r}, and no Keras model "
                "with that variable is being compiled, trained or evaluated. Pass the "
                "variable or layer itself."
            )
        source = variable
    variable = _variable_of(source, argument)
    if isinstance(variable, keras.Variable):
        scope = stateless_scope.get_stateless_scope()
        if scope is not None:
            value = scope.get_current_value(variable)
            if value is not None:
                return value
        if keras.backend.backend() == "jax":
            value = _value_in_jax_step(variable)
            if value is not None:
                return value
    return ops.convert_to_tensor(variable)


def _keep_untracked(metric, **sources):
    """Stores the table and bias on the metric without Keras tracking them.

    A `keras.Variable` set as a metric attribute would become one of the
    metric's own variables: reset to zero by `reset_state`, and a second
    copy of a model variable in the trainer's state.
    """
    for name, source in sources.items():
        object.__setattr__(metric, name, source)


def _position_weights(sample_weight, mask, lead_ndim, like, dtype):
    """Per-position weights `[M]`: `sample_weight` broadcast over positions, times the mask."""
    weights = ops.ones_like(like, dtype=dtype)
    if sample_weight is not None:
        sample_weight = ops.cast(ops.convert_to_tensor(sample_weight), dtype)
        while len(sample_weight.shape) > lead_ndim and sample_weight.shape[-1] == 1:
            sample_weight = ops.squeeze(sample_weight, -1)
        while len(sample_weight.shape) < lead_ndim:
            sample_weight = ops.expand_dims(sample_weight, -1)
        weights = weights * sample_weight
    if mask is not None:
        weights = weights * ops.cast(mask, dtype)
    return ops.reshape(weights, (-1,))


def _distinct_targets(ids, vocab_size, never):
    """Bool `[M, L]`: the first occurrence of each valid target id of a row.

    Valid: in `[0, V)` and not one of the ids in `never`.
    """
    ok = ops.logical_and(ids >= 0, ids < vocab_size)
    for item in never:
        ok = ops.logical_and(ok, ids != item)
    length = ids.shape[-1]
    if length is None or length <= 1:
        return ok
    same = ops.expand_dims(ids, 2) == ops.expand_dims(ids, 1)  # [M, L, L]
    earlier = ops.tril(ops.ones((length, length), dtype="bool"), k=-1)  # l' < l
    repeated = ops.any(
        ops.logical_and(ops.logical_and(same, earlier), ops.expand_dims(ok, 1)), axis=2
    )
    return ops.logical_and(ok, ops.logical_not(repeated))


def _check_k(k):
    ks = (k,) if isinstance(k, int) and not isinstance(k, bool) else tuple(k)
    if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
        raise ValueError(f"`k` must be a positive int or a sequence of them; received {k!r}.")
    return tuple(sorted(set(ks)))


def _check_exclude_ids(exclude_ids):
    if exclude_ids is None:
        return ()
    if isinstance(exclude_ids, int):
        exclude_ids = (exclude_ids,)
    try:
        ids = tuple(int(x) for x in exclude_ids)
    except TypeError as error:
        raise TypeError(
            f"`exclude_ids` must be None or a list of int item ids; received {exclude_ids!r}."
        ) from error
    if any(i != x for i, x in zip(ids, exclude_ids)):
        raise TypeError(f"`exclude_ids` must hold ints; received {exclude_ids!r}.")
    return ids


def _prepare(y_true, y_pred):
    mask = get_keras_mask(y_pred)
    y_pred = ops.convert_to_tensor(y_pred)
    y_true = cut_ops._check_ids(ops.convert_to_tensor(y_true), y_pred, "y_true")
    return y_true, y_pred, mask


class _ItemTableMetric(keras.metrics.Metric):
    """A metric that reads an item table (and bias) when it updates.

    Holds the table untracked (see `_keep_untracked`), resets its own
    variables to zero, and saves the table as a variable path that re-binds
    to the loaded model's variable.
    """

    def __init__(self, embeddings, bias, chunk_size, name, dtype):
        super().__init__(name=name, dtype=dtype or "float32")
        if embeddings is None:
            raise ValueError("`embeddings` is required: the item table [V, D].")
        cut_ops._check_chunk_size(chunk_size)
        _keep_untracked(self, embeddings=embeddings, bias=bias)
        self.chunk_size = chunk_size

    def reset_state(self):
        for variable in self.variables:
            variable.assign(ops.zeros(variable.shape, dtype=variable.dtype))

    def get_config(self):
        """Config with the table (and bias) saved as variable paths."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "embeddings": variable_path(self.embeddings, "embeddings"),
            "bias": variable_path(self.bias, "bias"),
            "chunk_size": self.chunk_size,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**rebind_variables(config))


@keras.saving.register_keras_serializable(package="keras_cutbce")
class TopKRetrieval(_ItemTableMetric):
    """hit@k, recall@k and ndcg@k of full-vocabulary retrieval, without logits.

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
            an `embeddings` variable (`keras.layers.Embedding`).
        k: an int or a sequence of ints, the cut-offs reported.
        exclude_ids: optional list of int item ids excluded everywhere.
        bias: optional `keras.Variable` `[V]`.
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

    def __init__(
        self,
        embeddings,
        k=(8, 10),
        exclude_ids=None,
        bias=None,
        chunk_size=None,
        name="top_k_retrieval",
        dtype=None,
    ):
        super().__init__(embeddings, bias, chunk_size, name, dtype)
        self.k = _check_k(k)
        self.exclude_ids = _check_exclude_ids(exclude_ids)
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
        y_true, y_pred, mask = _prepare(y_true, y_pred)
        table = _resolve(self.embeddings, "embeddings")
        bias = None if self.bias is None else _resolve(self.bias, "bias")
        vocab_size = int(table.shape[0])
        depth = min(max(self.k), vocab_size)

        exclusions = None
        if exclude_ids is not None:
            exclude_ids = cut_ops._check_ids(
                ops.convert_to_tensor(exclude_ids), y_pred, "exclude_ids"
            )
            exclusions = ops.cast(exclude_ids, "int32")
        if self.exclude_ids:
            constant = ops.zeros_like(y_pred[..., :1], dtype="int32") + ops.convert_to_tensor(
                self.exclude_ids, dtype="int32"
            )
            exclusions = (
                constant if exclusions is None else ops.concatenate([exclusions, constant], -1)
            )
        _, top_ids = cut_ops.cut_top_k(
            y_pred, table, depth, bias=bias, exclude_ids=exclusions, chunk_size=self.chunk_size
        )

        lead_ndim = len(y_pred.shape) - 1
        top_ids = ops.reshape(top_ids, (-1, depth))
        targets = ops.reshape(y_true, (ops.shape(top_ids)[0], ops.shape(y_true)[-1]))
        counted = _distinct_targets(targets, vocab_size, self.exclude_ids)  # [M, L]
        num_targets = ops.sum(ops.cast(counted, self.dtype), axis=1)  # [M]
        match = ops.expand_dims(top_ids, 2) == ops.expand_dims(ops.cast(targets, "int32"), 1)
        relevant = ops.cast(
            ops.any(ops.logical_and(match, ops.expand_dims(counted, 1)), axis=2), self.dtype
        )  # [M, depth]: the item at this rank is a target

        discounts = ops.convert_to_tensor(
            [1.0 / math.log2(rank + 2) for rank in range(depth)], dtype=self.dtype
        )
        hits_cum = ops.cumsum(relevant, axis=1)
        dcg_cum = ops.cumsum(relevant * discounts, axis=1)
        ideal_cum = ops.cumsum(discounts)

        weights = _position_weights(
            sample_weight, mask, lead_ndim, y_pred[..., 0], self.dtype
        )
        weights = weights * ops.cast(num_targets > 0, self.dtype)
        safe_targets = ops.maximum(num_targets, 1.0)
        for cut in self.k:
            last = min(cut, depth) - 1
            hits = hits_cum[:, last]
            ideal_last = ops.cast(ops.minimum(safe_targets, float(last + 1)), "int32") - 1
            values = {
                "hit": ops.cast(hits > 0, self.dtype),
                "recall": hits / safe_targets,
                "ndcg": dcg_cum[:, last] / ops.take(ideal_cum, ideal_last),
            }
            for measure, value in values.items():
                variable = self._sums[f"{measure}@{cut}"]
                variable.assign_add(ops.sum(weights * value))
        self.total_weight.assign_add(ops.sum(weights))

    def result(self):
        """Dict `{"hit@k", "recall@k", "ndcg@k"}` for every cut-off k."""
        return {
            key: ops.divide_no_nan(variable, self.total_weight)
            for key, variable in self._sums.items()
        }

    def get_config(self):
        return {
            **super().get_config(),
            "k": list(self.k),
            "exclude_ids": list(self.exclude_ids) or None,
        }


@keras.saving.register_keras_serializable(package="keras_cutbce")
class ThresholdConfusion(_ItemTableMetric):
    """Precision, recall and F1 of every item at a probability threshold, without logits.

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
    those without targets (mask padded positions out). The counts are float
    accumulators, exposed as the variables `true_positives`,
    `false_positives`, `false_negatives` and `true_negatives` (TN reaches
    `positions x V`: float32 keeps it to ~1e-7 relative precision).

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable.
        threshold: probability in `(0, 1)`.
        bias: optional `keras.Variable` `[V]`.
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

    def __init__(
        self,
        embeddings,
        threshold=0.5,
        bias=None,
        chunk_size=None,
        name="threshold_confusion",
        dtype=None,
    ):
        if not 0.0 < float(threshold) < 1.0:
            raise ValueError(
                f"`threshold` must be a probability in (0, 1); received {threshold!r}."
            )
        super().__init__(embeddings, bias, chunk_size, name, dtype)
        self.threshold = float(threshold)
        self.logit_threshold = math.log(self.threshold) - math.log1p(-self.threshold)
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
        y_true, y_pred, mask = _prepare(y_true, y_pred)
        table = _resolve(self.embeddings, "embeddings")
        bias = None if self.bias is None else _resolve(self.bias, "bias")
        vocab_size = int(table.shape[0])
        predicted = cut_ops.cut_count_at_least(
            y_pred, table, self.logit_threshold, bias=bias, chunk_size=self.chunk_size
        )

        depth = y_pred.shape[-1]
        hidden = ops.cast(ops.reshape(y_pred, (-1, depth)), "float32")
        targets = ops.reshape(y_true, (ops.shape(hidden)[0], ops.shape(y_true)[-1]))
        counted = _distinct_targets(targets, vocab_size, ())
        safe = ops.where(counted, targets, ops.zeros_like(targets))
        rows = ops.cast(ops.take(table, safe, axis=0), "float32")  # [M, L, D]
        logits = ops.sum(ops.expand_dims(hidden, 1) * rows, axis=-1)
        if bias is not None:
            logits = logits + ops.cast(ops.take(bias, safe, axis=0), "float32")
        hit = ops.logical_and(counted, logits >= self.logit_threshold)

        dtype = self.dtype
        positives = ops.sum(ops.cast(counted, dtype), axis=1)
        true_pos = ops.sum(ops.cast(hit, dtype), axis=1)
        predicted = ops.cast(ops.reshape(predicted, (-1,)), dtype)
        false_pos = ops.maximum(predicted - true_pos, 0.0)
        weights = _position_weights(
            sample_weight, mask, len(y_pred.shape) - 1, y_pred[..., 0], dtype
        )
        self.true_positives.assign_add(ops.sum(weights * true_pos))
        self.false_positives.assign_add(ops.sum(weights * false_pos))
        self.false_negatives.assign_add(ops.sum(weights * (positives - true_pos)))
        self.true_negatives.assign_add(
            ops.sum(weights * (float(vocab_size) - positives - false_pos))
        )

    def result(self):
        """Dict `{"precision", "recall", "f1"}`."""
        tp, fp, fn = self.true_positives, self.false_positives, self.false_negatives
        precision = ops.divide_no_nan(tp, tp + fp)
        recall = ops.divide_no_nan(tp, tp + fn)
        f1 = ops.divide_no_nan(2.0 * precision * recall, precision + recall)
        return {"precision": precision, "recall": recall, "f1": f1}

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}
