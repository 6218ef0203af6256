"""`CutBCELoss`, the Keras loss around `cut_binary_crossentropy`, and what Keras losses of this package share (`CutLoss`)."""

import math
import weakref
from typing import Optional

import keras
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce import registry
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import resolve_bias
from keras_cutbce.item_table import tables_config
from keras_cutbce.item_table import tables_from_config
from keras_cutbce.item_table import trainable_table_variables

__all__ = ["CutBCELoss"]

# model -> the table variables already found among its trainable variables.
_TRAINED_BY = weakref.WeakKeyDictionary()


class CutLoss(keras.losses.Loss):
    """The Keras loss around a loss op (`CutBCELoss`, `CutSoftmaxLoss`): tables, reductions, checks, config."""

    def __init__(self, embeddings, bias, options, *, reduction, name, dtype):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if embeddings is None:
            raise ValueError(
                "`embeddings` is required: the item table [V, D]. Received: embeddings=None"
            )
        self.embeddings = embeddings
        self.bias = bias
        self._options = options

    def _set_option(self, **change):
        options = self._options._replace(**change)
        self._options = checks.loss_options(*options)

    @property
    def label_smoothing(self):
        """The label smoothing, a float in `[0, 1]`."""
        return self._options.label_smoothing

    @label_smoothing.setter
    def label_smoothing(self, value):
        self._set_option(label_smoothing=value)

    @property
    def chunk_size(self):
        """The vocabulary tile width, or None for the default rule."""
        return self._options.chunk_size

    @chunk_size.setter
    def chunk_size(self, value):
        self._set_option(chunk_size=value)

    @property
    def implementation(self):
        """The implementation: `"auto"`, `"chunked"`, `"pallas"`, `"triton"` or `"reference"`."""
        return self._options.implementation

    @implementation.setter
    def implementation(self, value):
        self._set_option(implementation=value)

    def __call__(self, y_true, y_pred, sample_weight=None):
        mask = _keras_private.get_keras_mask(y_pred)
        with keras.name_scope(self.name), _keras_private.usable_after_refusal():
            y_pred = ops.convert_to_tensor(y_pred)
            table, bias, trained = self._tables()
            inputs = checks.loss_inputs(y_pred, table, self._integral_ids(y_true), bias)
            sample_weight = self._sample_weight(sample_weight, y_pred)
            if self.reduction in (None, "none"):
                return _keras_private.reduce_weighted_values(
                    self._loss(inputs, trained), sample_weight=self._merge_mask(sample_weight, mask),
                    reduction=self.reduction, dtype=self.dtype,
                )
            weights = self._row_weights(y_pred, sample_weight, mask)
            total = ops.cast(self._loss(inputs, trained, weights), self.dtype)
            if self.reduction != "sum":
                total = _keras_private.scale_loss_for_distribution(total)
            return total

    @staticmethod
    def _integral_ids(y_true):
        """Ids as given (host ids stay on the host, range-checked before any cast), except tf.distribute's float placeholder."""
        if keras.backend.backend() != "tensorflow" or not hasattr(y_true, "dtype"):
            return y_true
        if checks.is_int(y_true) or not keras.ops.is_tensor(y_true):
            return y_true
        import tensorflow as tf

        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            return ops.cast(y_true, "int32")
        return y_true

    def _sample_weight(self, sample_weight, y_pred):
        if sample_weight is None:
            return None
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=self.dtype)
        loss_dims = checks.static_dims(y_pred)[:-1]
        dims = checks.static_dims(sample_weight)
        if len(dims) == len(loss_dims) + 1 and dims[-1] == 1:
            effective = dims[:-1]
        else:
            effective = dims
            while 0 < len(effective) < len(loss_dims):
                sample_weight = ops.expand_dims(sample_weight, -1)
                effective = effective + (1,)
        checks.check_sample_weight(effective, loss_dims, received=dims)
        return sample_weight

    def _merge_mask(self, sample_weight, mask):
        """Keras's `apply_mask`, out of place (Keras's in-place product fails on torch for `[B, 1]` by `[B, T]`)."""
        if mask is None:
            return sample_weight
        mask = ops.convert_to_tensor(mask, dtype=self.dtype)
        float_mask = _keras_private.apply_mask(None, mask, self.dtype, self.reduction)
        if sample_weight is None:
            return float_mask
        float_mask, sample_weight = _keras_private.squeeze_or_expand_to_same_rank(
            float_mask, ops.cast(sample_weight, self.dtype)
        )
        return sample_weight * float_mask

    def _row_weights(self, y_pred, sample_weight, mask):
        ones = ops.ones_like(y_pred[..., 0], dtype=self.dtype)
        weights = self._merge_mask(sample_weight, mask)
        if weights is None:
            values = ones
        else:
            ones, weights = _keras_private.squeeze_or_expand_to_same_rank(ones, weights)
            values = ones * ops.cast(weights, self.dtype)
        if self.reduction == "sum":
            return values
        dims = checks.static_dims(ones)
        if self.reduction == "mean_with_sample_weight" and weights is not None:
            divisor = ops.sum(ops.cast(weights, self.dtype))
        elif None not in dims:  # the size made on the device (`ops.size` copies it from the host)
            divisor = ops.zeros((), self.dtype) + math.prod(dims)
        else:
            divisor = ops.cast(ops.size(ones), self.dtype)
        return ops.divide_no_nan(values, divisor)

    def _tables(self):
        """`(table, bias, trained)` read now; `trained`: their trainable values (the model must train them)."""
        table = ItemTable.read(self.embeddings, "embeddings")
        bias = resolve_bias(table, self.bias)
        bias = None if bias is None else ItemTable.read(bias, "bias")
        model = _keras_private.training_model()
        trained = []
        for part, role in ((table, "item table"), (bias, "bias")):
            if part is None:
                continue
            variables = trainable_table_variables(part.source)
            if variables:
                self._check_trained_by(model, variables, role)
                trained.append(part.value)
        if _keras_private.in_symbolic_scope():
            trained = []
        return table, bias, trained

    def _check_trained_by(self, model, variables, role="item table"):
        if model is None or not variables:
            return
        verified = _TRAINED_BY.setdefault(model, {})
        key = tuple(id(v) for v in variables)
        known = verified.get(key)
        if known is not None and all(a is b for a, b in zip(known, variables)):
            return
        owned = {id(v) for v in model.trainable_variables}
        missing = [v for v in variables if id(v) not in owned]
        if not missing:
            verified[key] = list(variables)
            return
        names = ", ".join(repr(v.path) for v in missing)
        cls = type(self).__name__
        if role == "bias":
            raise ValueError(
                f"{cls}'s bias is not among the trainable variables of the model "
                f"being trained ({model.name!r}): {names} would never be updated by "
                "`fit`. Let the model's item table layer own the bias: embed items with "
                "`items = keras_cutbce.ItemEmbedding(num_items, dim, use_bias=True)` "
                f"and pass `{cls}(items)` (no `bias=`): the loss and the metrics "
                "read the table and its bias, and both train. To keep a bias fixed on "
                "purpose, make it non-trainable (`keras.Variable(..., trainable=False)`) "
                "or pass it as a tensor. Received: bias="
                f"{getattr(missing[0], 'path', None)!r}"
            )
        raise ValueError(
            f"{cls}'s item table is not among the trainable variables of the "
            f"model being trained ({model.name!r}): {names} would never be updated "
            "by `fit`. Pass the model's own item table (the layer or variable the "
            f"model embeds items with, e.g. `{cls}(model.get_layer('items'))`), "
            "or build the model with that table as one of its layers. To keep a table "
            "fixed on purpose, make it non-trainable (`layer.trainable = False`, "
            "`keras.Variable(..., trainable=False)`) or pass it as a tensor."
        )

    def call(self, y_true, y_pred):
        """Computes the per-position loss `y_pred.shape[:-1]` for integer ids `y_true`."""
        table, bias, trained = self._tables()
        inputs = checks.loss_inputs(y_pred, table, self._integral_ids(y_true), bias)
        options = self._options
        return registry.run_loss(options.op, options.implementation, inputs, trained=trained,
                                 **options.keywords)

    def _loss(self, inputs, trained, row_weights=None):
        """The loss of checked `LossInputs`: per position, or `sum(row_weights * loss)` (`registry.run_loss`)."""
        options = self._options
        return registry.run_loss(options.op, options.implementation, inputs, row_weights=row_weights,
                                 trained=trained, **options.keywords)

    def get_config(self):
        """The config, the table (and bias) saved as variable paths (re-bound on `load_model`)."""
        config = super().get_config()
        config.update(
            **tables_config(self.embeddings, self.bias),
            label_smoothing=self.label_smoothing,
            chunk_size=self.chunk_size,
            implementation=self.implementation,
        )
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**tables_from_config(config))


@keras.saving.register_keras_serializable(package="keras_cutbce")
class CutBCELoss(CutLoss):
    """The full-vocabulary binary cross-entropy of hidden states `y_pred [..., D]` against item ids `y_true [..., L]`.

    Its value and gradients are `keras.losses.BinaryCrossentropy(from_logits=True)`
    on the dense logits of `y_pred` against the item table (for `pos_weight=1`),
    without the `[positions, V]` logits. `y_true` stays integral; ids outside
    `[0, V)` are padding, duplicates count once. Masks and `sample_weight` give
    Keras's numbers for every reduction. The table is read at each call, so it
    trains through the loss (docs/cutbce.md: custom JAX loops need a
    `keras.StatelessScope`).

    Args:
        embeddings: a `keras.Variable` `[V, D]`, a layer holding one as
            `embeddings` (`Embedding`, LoRA too, `ReversibleEmbedding`,
            `ItemEmbedding`, whose bias is used), or a constant array or tensor.
        bias: optional bias `[V]` for a table without its own: a constant or a
            `keras.Variable` of the model.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float, the weight of the positive terms.
        chunk_size: vocabulary tile width, `None` for the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX), `"triton"`
            (torch) or `"reference"` (dense).
        reduction: any Keras reduction.
        name: loss name.
        dtype: dtype of the reduced loss (default: Keras's float dtype).

    Raises:
        ValueError: a `sample_weight` that cannot broadcast; in `fit`, a
            trainable table or bias the model does not train.

    Example:

    ```python
    items = keras.layers.Embedding(num_items, 64, name="items")
    ids = keras.Input((None,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(64)(items(ids)))
    model.compile(optimizer="adam", loss=CutBCELoss(items))
    model.fit(sequences, next_items)   # next_items: int [batch, seq, 8]
    ```
    """

    def __init__(
        self,
        embeddings,
        bias=None,
        *,
        label_smoothing: float = 0.0,
        pos_weight: float = 1.0,
        chunk_size: Optional[int] = None,
        implementation: str = "auto",
        reduction: Optional[str] = "sum_over_batch_size",
        name: Optional[str] = "cut_binary_crossentropy",
        dtype: Optional[str] = None,
    ):
        options = checks.loss_options(label_smoothing, pos_weight, chunk_size, implementation)
        super().__init__(embeddings, bias, options, reduction=reduction, name=name, dtype=dtype)

    @property
    def pos_weight(self):
        """The weight of the positive terms, a finite float > 0."""
        return self._options.pos_weight

    @pos_weight.setter
    def pos_weight(self, value):
        self._set_option(pos_weight=value)

    def get_config(self):
        """Returns the config (`CutLoss.get_config`) with `pos_weight`."""
        config = super().get_config()
        config["pos_weight"] = self.pos_weight
        return config
