"""`CutBCELoss`: the Keras loss around `cut_binary_crossentropy`."""

import inspect

import keras
from keras import ops
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses.loss import apply_mask
from keras.src.losses.loss import reduce_weighted_values
from keras.src.losses.loss import scale_loss_for_distribution

from keras_cutbce import ops as cut_ops


def _variable_of(source, argument):
    """The `keras.Variable` behind a variable or an Embedding-like layer."""
    if isinstance(source, keras.layers.Layer):
        variable = getattr(source, "embeddings", None)
        if variable is None:
            raise TypeError(
                f"`{argument}` layer {source.name!r} has no `embeddings` variable "
                "(is it built?)."
            )
        return variable
    return source


def _find_model_variable(path):
    """Finds the variable at `path` in the Keras model being compiled or trained.

    Looks up the call stack for a method of a `keras.Model` (such as
    `compile_from_config` while `.keras` loading, or `compute_loss` in a
    train step) and returns that model's variable with the given path.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Model):
                for variable in owner.variables:
                    if variable.path == path:
                        return variable
            frame = frame.f_back
    finally:
        del frame
    return None


def variable_path(source, argument):
    """The path of the variable behind `source` (None and paths pass through)."""
    if source is None or isinstance(source, str):
        return source
    path = getattr(_variable_of(source, argument), "path", None)
    if path is None:
        raise ValueError(
            f"`{argument}` must be a keras.Variable or layer to be serialized; "
            f"received {type(source).__name__}."
        )
    return path


def rebind_variables(config):
    """`config` with its `embeddings`/`bias` paths bound to the model being loaded."""
    config = dict(config)
    for key in ("embeddings", "bias"):
        if isinstance(config.get(key), str):
            variable = _find_model_variable(config[key])
            if variable is not None:
                config[key] = variable
    return config


@keras.saving.register_keras_serializable(package="keras_cutbce")
class CutBCELoss(keras.losses.Loss):
    """Full-vocabulary binary cross-entropy of hidden states against item ids.

    The model outputs hidden states `y_pred [..., D]`; the loss projects them
    on the item table `E [V, D]` (plus an optional bias `[V]`) tile by tile
    and compares the logits with the multi-hot of the integer target ids
    `y_true [..., L]`, without materializing the `[positions, V]` logits. Its
    value equals `keras.losses.BinaryCrossentropy(from_logits=True)` on the
    dense logits (for `pos_weight=1`), and so do its gradients.

    `y_true` stays integral (Keras's stock `Loss` would cast it to float,
    which is exact only below 2**24). Ids outside `[0, V)` are padding;
    duplicates count once. Keras masks on `y_pred` and `sample_weight` work
    as for any loss; a `sample_weight` of lower rank than the per-position
    loss is broadcast over the trailing positions.

    The table is read when the loss is called, so inside a train step it is
    the value being trained: tie it to the model's item embedding and the
    table trains through the loss on every backend.

    Args:
        embeddings: a `keras.Variable` `[V, D]` or a layer holding one as
            `embeddings` (`keras.layers.Embedding`, `ReversibleEmbedding`).
        bias: optional `keras.Variable` `[V]`.
        label_smoothing: float in `[0, 1]`.
        pos_weight: positive float weighting the positive terms.
        chunk_size: vocabulary tile width, `None` for the default rule
            (`keras_cutbce.tiling`).
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX) or
            `"reference"` (dense).
        reduction: any Keras reduction (`"sum_over_batch_size"`, `"sum"`,
            `"mean"`, `"mean_with_sample_weight"`, `"none"`/`None`).
        name: loss name.
        dtype: dtype of the reduced loss (default: Keras's float dtype).

    Example:

    ```python
    items = keras.layers.Embedding(num_items, 64, name="items")
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
        label_smoothing=0.0,
        pos_weight=1.0,
        chunk_size=None,
        implementation="auto",
        reduction="sum_over_batch_size",
        name="cut_binary_crossentropy",
        dtype=None,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        cut_ops._check_implementation(implementation)
        cut_ops._check_chunk_size(chunk_size)
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(
                f"`label_smoothing` must be in [0, 1]; received {label_smoothing!r}."
            )
        if not float(pos_weight) > 0.0:
            raise ValueError(f"`pos_weight` must be > 0; received {pos_weight!r}.")
        if embeddings is None:
            raise ValueError("`embeddings` is required: the item table [V, D].")
        self.embeddings = embeddings
        self.bias = bias
        self.label_smoothing = float(label_smoothing)
        self.pos_weight = float(pos_weight)
        self.chunk_size = chunk_size
        self.implementation = implementation

    def _resolve(self, source, argument):
        if isinstance(source, str):
            variable = _find_model_variable(source)
            if variable is None:
                raise ValueError(
                    f"`{argument}` refers to the variable {source!r}, and no Keras "
                    "model with that variable is being compiled or trained. Pass "
                    "the variable or layer itself, or compile the model that owns it."
                )
            return variable
        return _variable_of(source, argument)

    def __call__(self, y_true, y_pred, sample_weight=None):
        in_mask = get_keras_mask(y_pred)
        with keras.name_scope(self.name):
            y_pred = ops.convert_to_tensor(y_pred)
            y_true = self._integral_ids(ops.convert_to_tensor(y_true))
            if self.reduction in (None, "none"):
                losses = self.call(y_true, y_pred)
                return reduce_weighted_values(
                    losses, sample_weight=self._broadcast(sample_weight, losses.shape),
                    mask=in_mask, reduction=self.reduction, dtype=self.dtype,
                )
            weights = self._row_weights(
                ops.shape(y_pred)[:-1], sample_weight, in_mask
            )
            embeddings, bias = self._tables()
            total = cut_ops.weighted_loss_sum(
                y_pred, embeddings, y_true, weights, bias, **self._op_kwargs()
            )
            total = ops.cast(total, self.dtype)
            if self.reduction != "sum":
                total = scale_loss_for_distribution(total)
            return total

    @staticmethod
    def _integral_ids(y_true):
        """Ids as given, except the float placeholder of a tf.distribute build.

        Under a `tf.distribute` strategy Keras builds the compiled loss once,
        in cross-replica context, from the replicas' mean of the first batch:
        a float tensor where only the shape matters. Anywhere else float ids
        are an error (raised by the op).
        """
        if keras.backend.backend() == "tensorflow" and not cut_ops._is_int(y_true):
            import tensorflow as tf

            if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
                return ops.cast(y_true, "int32")
        return y_true

    def _broadcast(self, sample_weight, shape):
        """`sample_weight` as `self.dtype`, broadcast over trailing positions."""
        if sample_weight is None:
            return None
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=self.dtype)
        while len(sample_weight.shape) < len(shape):
            sample_weight = ops.expand_dims(sample_weight, -1)
        return sample_weight * ops.ones(shape, self.dtype)  # a real copy, not a view

    def _row_weights(self, lead_shape, sample_weight, mask):
        """Per-position weights `w` with `reduction(losses) == sum(w * losses)`.

        Follows Keras's `reduce_weighted_values`: the mask is merged into the
        sample weight (`apply_mask`), then `"sum"` keeps it, `"mean"` and
        `"sum_over_batch_size"` divide by the number of positions, and
        `"mean_with_sample_weight"` by the sum of the (masked) weights.
        """
        ones = ops.ones(lead_shape, self.dtype)
        weights = None
        if sample_weight is not None:
            weights = self._broadcast(sample_weight, lead_shape)
        if mask is not None:
            weights = apply_mask(weights, ops.cast(mask, self.dtype), self.dtype, self.reduction)
            weights = ops.broadcast_to(weights, lead_shape)
        if self.reduction == "sum":
            return ones if weights is None else weights
        if self.reduction == "mean_with_sample_weight" and weights is not None:
            divisor = ops.sum(weights)
        else:
            divisor = ops.cast(ops.size(ones), self.dtype)
        return ops.divide_no_nan(ones if weights is None else weights, divisor)

    def _tables(self):
        embeddings = self._resolve(self.embeddings, "embeddings")
        bias = None if self.bias is None else self._resolve(self.bias, "bias")
        return embeddings, bias

    def _op_kwargs(self):
        return dict(
            label_smoothing=self.label_smoothing,
            pos_weight=self.pos_weight,
            chunk_size=self.chunk_size,
            implementation=self.implementation,
        )

    def call(self, y_true, y_pred):
        """Per-position loss `y_pred.shape[:-1]` for integer ids `y_true`."""
        embeddings, bias = self._tables()
        return cut_ops.cut_binary_crossentropy(
            y_pred, embeddings, y_true, bias, **self._op_kwargs()
        )

    def get_config(self):
        """Config with the table (and bias) saved as variable paths.

        On load inside `keras.saving.load_model`, the paths re-bind to the
        loaded model's variables.
        """
        config = super().get_config()
        config.update(
            embeddings=variable_path(self.embeddings, "embeddings"),
            bias=variable_path(self.bias, "bias"),
            label_smoothing=self.label_smoothing,
            pos_weight=self.pos_weight,
            chunk_size=self.chunk_size,
            implementation=self.implementation,
        )
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**rebind_variables(config))
