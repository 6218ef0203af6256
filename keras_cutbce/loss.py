"""`CutBCELoss`, the Keras loss around `cut_binary_crossentropy`, and what Keras losses of this package share (`CutLoss`)."""

import weakref
from typing import Optional

import keras
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import resolve_bias
from keras_cutbce.item_table import tables_config
from keras_cutbce.item_table import tables_from_config
from keras_cutbce.item_table import trainable_table_variables

__all__ = ["CutBCELoss"]

# model -> the table variables already found among its trainable variables.
_TRAINED_BY = weakref.WeakKeyDictionary()


class CutLoss(keras.losses.Loss):
    """The Keras loss around a loss op of this package: what `CutBCELoss` and `CutSoftmaxLoss` share.

    The item table and bias read at each call, the Keras reductions, sample
    weights and masks, integral ids, the checks that `fit` trains the table,
    and the config (the table saved as variable paths). A subclass gives its
    checked `checks.LossOptions` (whose `family` picks the op).
    """

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
        with keras.name_scope(self.name):
            y_pred = ops.convert_to_tensor(y_pred)
            y_true = self._integral_ids(y_true)
            y_pred, table, bias = self._tables(y_pred)
            inputs = cut_ops.loss_inputs(y_pred, table, y_true, bias)
            sample_weight = self._sample_weight(sample_weight, y_pred)
            if self.reduction in (None, "none"):
                losses = ops.reshape(
                    cut_ops.per_position_loss(inputs, self._options), inputs.lead_shape
                )
                return _keras_private.reduce_weighted_values(
                    losses, sample_weight=self._merge_mask(sample_weight, mask),
                    reduction=self.reduction, dtype=self.dtype,
                )
            weights = self._row_weights(y_pred, sample_weight, mask)
            total = cut_ops.loss_sum(inputs, self._options, weights)
            total = ops.cast(total, self.dtype)
            if self.reduction != "sum":
                total = _keras_private.scale_loss_for_distribution(total)
            return total

    @staticmethod
    def _integral_ids(y_true):
        """Ids as given, except the float placeholder of a tf.distribute build.

        Host (NumPy) ids stay on the host, so int64 ids are range-checked
        before any conversion could wrap them. Under a `tf.distribute`
        strategy Keras builds the compiled loss once, in cross-replica
        context, from the replicas' mean of the first batch: a float tensor
        where only the shape matters. Anywhere else float ids are an error
        (raised by the op).
        """
        if keras.backend.backend() != "tensorflow" or not hasattr(y_true, "dtype"):
            return y_true
        if checks.is_int(y_true) or not keras.ops.is_tensor(y_true):
            return y_true
        import tensorflow as tf

        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            return ops.cast(y_true, "int32")
        return y_true

    def _sample_weight(self, sample_weight, y_pred):
        """`sample_weight` as `self.dtype` with the rank Keras's reduction expects.

        As in Keras, a trailing size-1 axis is dropped (`[B, 1]` for `[B]`
        losses is kept for Keras's own rank adjustment); a weight of lower
        rank than the per-position loss (one a sequence, `[B]` for `[B, T]`)
        is expanded over the trailing positions. Raises a `ValueError` naming
        both shapes when it cannot broadcast.
        """
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
        """Keras's `apply_mask` (the mask merged into the sample weight), out of place.

        (Keras multiplies in place, which fails on torch for a `[B, 1]` weight
        and a `[B, T]` mask.)
        """
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
        """Per-position weights `w` with `reduction(losses) == sum(w * losses)`.

        Keras's `reduce_weighted_values` step by step, on a tensor of ones in
        place of the losses: the mask merged into the sample weight
        (`apply_mask`), Keras's rank adjustment, then `"sum"` keeps the
        weights, `"mean"`/`"sum_over_batch_size"` divide by the number of
        positions and `"mean_with_sample_weight"` by the sum of the weights
        (in their own shape: a weight per example counts once, as in Keras).
        """
        ones = ops.ones_like(y_pred[..., 0], dtype=self.dtype)
        weights = self._merge_mask(sample_weight, mask)
        if weights is None:
            values = ones
        else:
            ones, weights = _keras_private.squeeze_or_expand_to_same_rank(ones, weights)
            values = ones * ops.cast(weights, self.dtype)
        if self.reduction == "sum":
            return values
        if self.reduction == "mean_with_sample_weight" and weights is not None:
            divisor = ops.sum(ops.cast(weights, self.dtype))
        else:
            divisor = ops.cast(ops.size(ones), self.dtype)
        return ops.divide_no_nan(values, divisor)

    def _tables(self, y_pred):
        """`(y_pred, table, bias)`: the table (an `ItemTable`) and bias values read now.

        A trainable table must be trained by the model being fitted: inside a
        `train_step` whose model does not hold it, this raises (see
        `_check_trained_by`). On JAX, a trainable table held in a
        `keras.Variable` whose value is concrete while `y_pred` is traced
        (`jax.jit`/`jax.grad` over `model.stateless_call` without a
        `keras.StatelessScope`) is baked in as a constant: fine for a forward
        pass, but differentiating it would silently drop the table's gradient,
        so `y_pred` is returned wrapped to raise if (and only if) it is
        differentiated (`backends/jax/table_guard.py`). A frozen table
        (`trainable=False`, a constant) is never refused.
        """
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
            trained += [(part.value, variable) for variable in variables]
        if keras.backend.backend() == "jax" and trained:
            from keras_cutbce.backends.jax import table_guard

            if table_guard.table_would_be_constant(y_pred, [value for value, _ in trained]) and (
                not _keras_private.in_symbolic_scope()
            ):
                y_pred = table_guard.refuse_differentiation(y_pred)
        return y_pred, table, bias

    def _check_trained_by(self, model, variables, role="item table"):
        """Raises if `model` is being trained and does not train the `variables` of the table or bias.

        `role` (`"item table"` or `"bias"`) names what they are in the
        message. A model found to train them is remembered (per model), so
        the next steps skip the walk over the model's variables.
        """
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
        y_pred, table, bias = self._tables(y_pred)
        inputs = cut_ops.loss_inputs(y_pred, table, y_true, bias)
        return ops.reshape(cut_ops.per_position_loss(inputs, self._options), inputs.lead_shape)

    def get_config(self):
        """Returns the config, with the table (and bias) saved as variable paths.

        On load inside `keras.saving.load_model`, the paths re-bind to the
        loaded model's variables (or to the LoRA-enabled layer that owns it).
        """
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
    """Computes the full-vocabulary binary cross-entropy of hidden states against item ids.

    The model outputs hidden states `y_pred [..., D]`; the loss projects them
    on the item table `E [V, D]` (plus an optional bias `[V]`) tile by tile
    and compares the logits with the multi-hot of the integer target ids
    `y_true [..., L]`, without materializing the `[positions, V]` logits. Its
    value equals `keras.losses.BinaryCrossentropy(from_logits=True)` on the
    dense logits (for `pos_weight=1`), and so do its gradients.

    `y_true` stays integral (Keras's stock `Loss` would cast it to float,
    which is exact only below 2**24). Ids outside `[0, V)` are padding, of
    any integer width (an int64 `2**32 + 16` is padding, not item 16);
    duplicates count once. Keras masks on `y_pred` and `sample_weight` give
    Keras's numbers and shapes for every reduction (a trailing size-1 axis as
    in Keras; a `[B]` weight over `[B, T]` losses is one weight per example,
    Keras's `[B, 1]`); a weight that cannot broadcast raises a `ValueError`
    naming both shapes.

    The table is read when the loss is called, so inside a train step it is
    the value being trained: tie it to the model's item embedding and the
    table trains through the loss on every backend. In a JAX custom loop
    (`model.stateless_call` under `jax.grad`), call the loss inside
    `keras.StatelessScope(state_mapping=...)` with the values being
    differentiated (or use `model.stateless_compute_loss`); without them the
    loss raises instead of silently dropping the table's gradient.

    Args:
        embeddings: a `keras.Variable` `[V, D]` or a layer holding one as
            `embeddings` (`keras.layers.Embedding`, LoRA-enabled too,
            `ReversibleEmbedding`, `keras_cutbce.ItemEmbedding`), or a
            constant `[V, D]` array or tensor. An `ItemEmbedding` built with
            `use_bias=True` gives its bias too: the trainable bias of a
            model (it trains with the table).
        bias: optional bias `[V]`, for a table without its own: a constant
            array or tensor, or a `keras.Variable` of the model (a trainable
            variable outside the model is refused by `fit`, as the table).
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width, `None` for the default rule
            (`keras_cutbce.math.tiling`).
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX),
            `"triton"` (torch) or `"reference"` (dense).
        reduction: any Keras reduction (`"sum_over_batch_size"`, `"sum"`,
            `"mean"`, `"mean_with_sample_weight"`, `"none"`/`None`).
        name: loss name.
        dtype: dtype of the reduced loss (default: Keras's float dtype).

    Example:

    ```python
    items = keras.layers.Embedding(num_items, 64, name="items")
    # or, with a trainable per-item bias the loss reads (and trains) too:
    # items = keras_cutbce.ItemEmbedding(num_items, 64, use_bias=True, name="items")
    ids = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Dense(64)(items(ids))
    model = keras.Model(ids, hidden)
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
