"""The losses a SASRec user compares with `CutBCELoss`: sampled BCE and full softmax.

Both read the same item table (`Embedding`, row 0 = padding) and per-item
output bias as `CutBCELoss` and `DenseBCELoss`, and take targets `[..., L]`
int ids (-1 = padding), so one model and one evaluation serve every loss.

- `SampledBCELoss`: BCE on each positive and `N` negatives drawn uniformly
  from the catalogue for it (the original SASRec / keras-rs recipe is
  `N = 1`); only those `1 + N` logits are formed. The negatives come with the
  targets, `y_true = concat([targets [..., L], negatives [..., L * N]])`,
  drawn afresh for every batch by `NegativeSamplingBatches` (numpy, so the
  draws are the same on every backend and need no random state in the
  train step).
- `SoftmaxCrossEntropyLoss`: full-catalogue softmax cross-entropy of each
  target (the padding row excluded from the softmax), through the dense
  `[..., V]` logits.
- `CutSoftmaxCrossEntropyLoss`: the same value and gradients without the
  logits, through `keras_cutbce.cut_categorical_crossentropy` (the op of
  `CutSoftmaxLoss`), the padding row left out of the softmax by its bias.

Example:

```python
import keras, numpy as np
from examples.sasrec.losses import NegativeSamplingBatches, SampledBCELoss

items = keras.layers.Embedding(101, 8)
items.build((None,))
batches = NegativeSamplingBatches(
    inputs=np.ones((4, 5), "int32"), targets=np.ones((4, 5, 2), "int32"),
    weights=np.ones((4, 5), "float32"), batch_size=2, num_items=100, num_negatives=3)
x, y, w = batches[0]                   # y: [2, 5, 2 + 2 * 3]
loss = SampledBCELoss(items, num_targets=2, num_negatives=3)
value = loss(y, np.zeros((2, 5, 8), "float32"), sample_weight=w)   # log(2) at zero logits
```
"""

import math

import keras
import numpy as np
from keras import ops


def _table_and_bias(embeddings, bias, dtype):
    table = ops.cast(ops.convert_to_tensor(embeddings.embeddings), dtype)
    bias = None if bias is None else ops.cast(ops.convert_to_tensor(bias), dtype)
    return table, bias


def _mean_over_valid(per_target, valid):
    """Mean of `per_target [..., L]` over the valid targets; 0 where none is valid."""
    valid = ops.cast(valid, per_target.dtype)
    total = ops.sum(per_target * valid, axis=-1)
    return total / ops.maximum(ops.sum(valid, axis=-1), 1.0)


@keras.saving.register_keras_serializable(package="examples_sasrec")
class SampledBCELoss(keras.losses.Loss):
    """BCE on every positive plus `num_negatives` uniformly sampled negatives each.

    Per target `t` with logit `z_t` and negatives `n_1..n_N` (logits `z_n`):
    `(softplus(-z_t) + sum_n softplus(z_n)) / (1 + N)`, i.e. the mean BCE of
    its `1 + N` logits (with `N = 1`, keras-rs's SASRec loss). The loss of a
    position is the mean over its valid targets (ids in `[0, V)`); a position
    without targets gives 0. A negative that happens to equal a positive is
    kept as a negative (uniform sampling, as in the recipe).

    Memory: the gathered rows `[..., L * N, D]`, so it grows with `N`, not
    with the catalogue.

    Args:
        embeddings: the item `Embedding` layer (its table gives the logits).
        bias: optional per-item output bias `[V]`.
        num_targets: `L`, the positive ids per position at the front of `y_true`.
        num_negatives: `N`, negatives per target after them (`L * N` columns).
    """

    def __init__(self, embeddings, bias=None, num_targets=8, num_negatives=1,
                 name="sampled_binary_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        if num_negatives < 1:
            raise ValueError(f"num_negatives must be >= 1; received {num_negatives}.")
        self.embeddings, self.bias = embeddings, bias
        self.num_targets, self.num_negatives = int(num_targets), int(num_negatives)

    def call(self, y_true, y_pred):
        table, bias = _table_and_bias(self.embeddings, self.bias, y_pred.dtype)
        num_rows = ops.shape(table)[0]
        ids = ops.cast(y_true, "int32")
        targets, negatives = ids[..., : self.num_targets], ids[..., self.num_targets :]
        valid = ops.logical_and(ops.greater_equal(targets, 0), ops.less(targets, num_rows))
        candidates = ops.concatenate([ops.where(valid, targets, 0), negatives], axis=-1)
        rows = ops.take(table, candidates, axis=0)  # [..., L + L * N, D]
        logits = ops.squeeze(ops.matmul(rows, ops.expand_dims(y_pred, -1)), -1)
        if bias is not None:
            logits = logits + ops.take(bias, candidates, axis=0)
        positive = ops.softplus(-logits[..., : self.num_targets])  # [..., L]
        shape = ops.shape(targets)
        negative = ops.reshape(
            ops.softplus(logits[..., self.num_targets :]),
            tuple(shape) + (self.num_negatives,),
        )
        per_target = (positive + ops.sum(negative, axis=-1)) / (1.0 + self.num_negatives)
        return _mean_over_valid(per_target, valid)


@keras.saving.register_keras_serializable(package="examples_sasrec")
class SoftmaxCrossEntropyLoss(keras.losses.Loss):
    """Full-catalogue softmax cross-entropy of each target, mean over the targets.

    Per position with logits `z = h E^T + b` over the catalogue (the padding
    row `padding_id` excluded) and valid targets `t_1..t_k` (ids in
    `[0, V)`, not the padding row): `mean_j (logsumexp(z) - z_{t_j})`; a
    position without targets gives 0. It builds the dense `[..., V]` logits.

    Args:
        embeddings: the item `Embedding` layer.
        bias: optional per-item output bias `[V]`.
        padding_id: table row left out of the softmax (None: none).
    """

    def __init__(self, embeddings, bias=None, padding_id=0,
                 name="softmax_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.embeddings, self.bias, self.padding_id = embeddings, bias, padding_id

    def call(self, y_true, y_pred):
        table, bias = _table_and_bias(self.embeddings, self.bias, y_pred.dtype)
        num_rows = ops.shape(table)[0]
        ids = ops.cast(y_true, "int32")
        valid = ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, num_rows))
        logits = ops.matmul(y_pred, ops.transpose(table))
        if bias is not None:
            logits = logits + bias
        if self.padding_id is not None:
            valid = ops.logical_and(valid, ops.not_equal(ids, self.padding_id))
            column = ops.arange(num_rows) == self.padding_id
            logits = ops.where(column, ops.cast(-1e9, logits.dtype), logits)
        log_normalizer = ops.logsumexp(logits, axis=-1, keepdims=True)
        target_logits = ops.take_along_axis(logits, ops.where(valid, ids, 0), axis=-1)
        return _mean_over_valid(log_normalizer - target_logits, valid)


@keras.saving.register_keras_serializable(package="examples_sasrec")
class CutSoftmaxCrossEntropyLoss(SoftmaxCrossEntropyLoss):
    """`SoftmaxCrossEntropyLoss` without the `[..., V]` logits.

    The per-position loss of `keras_cutbce.CutSoftmaxLoss`
    (`cut_categorical_crossentropy`: `logsumexp(z) - mean_j z_{t_j}`, tile by
    tile over the catalogue), with the padding row `padding_id` out of the
    softmax (its bias set to -1e9, so its probability and gradients are 0)
    and out of the targets, as in `SoftmaxCrossEntropyLoss`: the same value
    and gradients, and the same Keras reduction of the per-position losses.
    """

    def __init__(self, embeddings, bias=None, padding_id=0,
                 name="cut_softmax_crossentropy", **kwargs):
        super().__init__(embeddings, bias, padding_id=padding_id, name=name, **kwargs)

    def call(self, y_true, y_pred):
        from keras_cutbce import cut_categorical_crossentropy

        table, bias = _table_and_bias(self.embeddings, self.bias, y_pred.dtype)
        ids = ops.cast(y_true, "int32")
        if self.padding_id is not None:
            column = ops.arange(ops.shape(table)[0]) == self.padding_id
            bias = ops.zeros(ops.shape(table)[:1], table.dtype) if bias is None else bias
            bias = ops.where(column, ops.cast(-1e9, bias.dtype), bias)
            ids = ops.where(ops.equal(ids, self.padding_id), -1, ids)
        per_position = cut_categorical_crossentropy(y_pred, table, ids, bias)
        return ops.cast(per_position, y_pred.dtype)


class NegativeSamplingBatches(keras.utils.PyDataset):
    """Shuffled batches `(inputs, concat(targets, negatives), weights)` for `SampledBCELoss`.

    Every batch draws `num_negatives` ids per target uniformly from
    `1..num_items` (row 0 is padding), `[B, T, L * N]`, with a numpy generator
    seeded by `seed`; the order of the windows is reshuffled every epoch.

    Args:
        inputs, targets, weights: the `training_arrays` outputs.
        batch_size: windows per batch (the last batch may be smaller).
        num_items: catalogue size.
        num_negatives: `N` per target.
        seed: seed of the shuffles and the draws.
    """

    def __init__(self, inputs, targets, weights, batch_size, num_items, num_negatives=1,
                 seed=0, shuffle=True, **kwargs):
        super().__init__(**kwargs)
        self.inputs, self.targets, self.weights = inputs, targets, weights
        self.batch_size, self.num_items = int(batch_size), int(num_items)
        self.num_negatives, self.shuffle = int(num_negatives), shuffle
        self.rng = np.random.default_rng(seed)
        self.order = self._new_order()

    def _new_order(self):
        n = len(self.inputs)
        return self.rng.permutation(n) if self.shuffle else np.arange(n)

    def __len__(self):
        return math.ceil(len(self.inputs) / self.batch_size)

    def __getitem__(self, index):
        rows = self.order[index * self.batch_size : (index + 1) * self.batch_size]
        targets = self.targets[rows]
        shape = targets.shape[:-1] + (targets.shape[-1] * self.num_negatives,)
        negatives = self.rng.integers(1, self.num_items + 1, size=shape, dtype=np.int32)
        return self.inputs[rows], np.concatenate([targets, negatives], axis=-1), self.weights[rows]

    def on_epoch_end(self):
        self.order = self._new_order()
